%% @private
%% The sender's side of a message sent in pieces (`convoy_chunk'): runs in the
%% caller of `convoy:send/2', which `convoy_send' lets do so only where its
%% ordering rules allow a message to go to its lane's inbox (the lane holds
%% nothing of the sender's).
%%
%% The sender encodes the message once (`convoy_chunk:payload/2'), sends the first
%% piece to its lane's inbox on the peer (the inbox its batches use) and waits for
%% that piece's ack (or `refused': the peer's reassembly bound is reached; the
%% ack waits while another message of this node streams to that inbox, for half
%% the peer's `barrier_timeout' at most, see `convoy_chunk''s "Turns"), then
%% sends the others with at most `chunk_window' unacknowledged (a peer at
%% protocol version 3 acknowledges every `chunk_window div 2' of them, see
%% `start/8'), and finally waits for the inbox's `delivered'. Each piece is a
%% batch of one entry: other traffic to the node travels between them. The
%% sender does not return before the message is delivered, so its later messages
%% cannot overtake it, and, since the inbox delivers in order, everything it sent
%% through that inbox before was delivered too: it may send directly again (as
%% after a barrier).
%%
%% The sender never makes a call that a busy connection can suspend: pieces go
%% `nosuspend' (or through a helper, see the bounds), and it sets up and removes
%% no remote monitor (each is a signal to the peer, queued and suspending its
%% sender like a message sent with `!'). Each message has a keeper, a process
%% that the first piece names as the message's sender: it owns the alias the
%% inbox answers to and the monitor of the inbox (its signals may suspend the
%% keeper, never the sender), and relays answers and the inbox's death to an
%% alias of the sender's, unaliased when the send ends (a later answer is dropped
%% by the runtime, none stays in the sender's mailbox). The inbox holds the
%% partial message only while its keeper lives: the sender kills the keeper to
%% give the message up (`no_answer', `dropped'), and the inbox discards it at
%% the keeper's `DOWN'; after `sent' the keeper lives on until the inbox delivers
%% the message or goes; it watches the sender too, so a sender that dies gives
%% its message up. Bounds:
%% <ul>
%% <li>no answer to the first piece within `barrier_timeout' ms: `no_answer'
%%   (counted `stalled'); `convoy_send' hands the message to the lane whole
%%   (behind that piece, in the same inbox; the piece is never completed and is
%%   discarded when its keeper goes), unless that piece was the whole message:
%%   then it is `sent';</li>
%% <li>no ack while the window is full for `barrier_timeout' ms: the remaining
%%   pieces go unpaced (counted `stalled'), so a receiver that stopped acking
%%   delays the message by at most that much;</li>
%% <li>no `delivered' within `barrier_timeout' ms of the last ack: `sent'
%%   (counted `stalled'): the message is on its way but the sender's later
%%   messages must follow it through the inbox (it stays marked);</li>
%% <li>a busy distribution connection: a helper process sends the piece
%%   (suspended until the connection takes it, as `!' would be) while the sender
%%   waits for it at most `block_timeout' ms; then the rest of the message is
%%   dropped and counted (`dropped'), and the receiver discards the partial when
%%   its keeper's `DOWN' comes through;</li>
%% <li>the inbox's node not connected, or the inbox gone, before the last piece:
%%   dropped and counted; after it: `sent' (delivered or not, as with `!').</li>
%% </ul>
-module(convoy_chunk_send).

-export([inbox/4, inbox_name/1, send/6]).

-export_type([target/0]).

-include("convoy_runtime.hrl").

-define(SEND_OPTS, [nosuspend, noconnect]).

%% Where the pieces go: the peer inbox's name, and the protocol version the peer
%% negotiated (which kinds of pieces it reads, see `convoy_wire').
-opaque target() :: {atom(), pos_integer()}.

%% @doc The peer inbox that a large message (of `Bytes', its encoded size) from
%% lane `L' to `Node' goes to in pieces, with the node's counters; `none' when it
%% goes whole (under `chunk_threshold', no small traffic to protect within
%% `chunk_guard' (`convoy_path:pieces/3'), or the peer does not read pieces).
%%
%% Small traffic on any lane counts: every lane's messages to `Node' share its
%% one distribution connection, so a large message sent whole delays them all.
-spec inbox(#runtime{}, pos_integer(), node(), non_neg_integer()) ->
          {target(), counters:counters_ref()} | none.
inbox(RT = #runtime{chunk_threshold = T, chunk_guard = G}, L, Node, Bytes) ->
    Since = convoy_slots:now_us(RT#runtime.clock) - latest_small_send(RT#runtime.slots),
    case convoy_path:pieces(Bytes, T, {G, Since}) of
        false ->
            none;
        true ->
            case convoy_peers:lookup(Node) of
                {{convoy, Vsn, Inboxes}, C, _H} ->
                    case convoy_wire:supports(Vsn, piece) of
                        true -> {{convoy_wire:lane_inbox(L, Inboxes), Vsn}, C};
                        false -> none
                    end;
                _ ->
                    none
            end
    end.

latest_small_send(Slots) ->
    lists:max([convoy_slots:last_small_send(S) || S <- tuple_to_list(Slots)]).

%% @doc The name of the peer's inbox that `Target' sends pieces to.
-spec inbox_name(target()) -> atom().
inbox_name({Inbox, _Vsn}) -> Inbox.


%% @doc Send `Msg' to `To' on `Node' in pieces through the inbox of `Target'
%% (from `inbox/4'). `delivered': the inbox delivered it; `sent': handed over,
%% delivery not confirmed; `refused' (nothing sent but a refused first piece: the
%% inbox has delivered everything before it) or `no_answer' (the first piece may
%% be held or not): the caller sends the message whole; `dropped': counted.
-spec send(#runtime{}, node(), target(), counters:counters_ref(), convoy_wire:dest(),
           term()) ->
          delivered | sent | refused | no_answer | dropped.
send(RT = #runtime{chunk_bytes = PB}, Node, {Inbox, Vsn}, C, To, Msg) ->
    {Kind, Data} = convoy_chunk:payload(Msg, convoy_wire:supports(Vsn, piece_path)),
    case convoy_chunk:pieces(Data, PB) of
        {0, []} ->
            refused; % nothing to cut: it goes whole
        {Size, [First | Rest]} ->
            Dest = {Inbox, Node},
            Reply = alias([explicit_unalias]),
            {Keeper, Ref} = keeper(Dest, Reply),
            Ids = {Ref, Reply},
            Start = start(RT, Vsn, Ids, Keeper, To, Kind, Size, First),
            Result = first(RT, Dest, Ids, C, Start, Rest),
            release(Keeper, Reply, Result),
            counted(C, Result)
    end.

counted(C, dropped) ->
    convoy_metrics:add(C, accepted, 1),
    convoy_metrics:add(C, dropped, 1),
    dropped;
counted(_C, Result) ->
    Result.

%% Start the message's keeper (see the module header) and get the alias it
%% answers to; it sets up its monitors only after that, so the sender never
%% waits for the connection.
keeper(Dest, Reply) ->
    Sender = self(),
    Keeper = spawn(fun() -> keeper_init(Dest, Reply, Sender) end),
    receive
        {Reply, keeper, Keeper, Ref} -> {Keeper, Ref}
    end.

keeper_init(Dest, Reply, Sender) ->
    Ref = alias(),
    Reply ! {Reply, keeper, self(), Ref},
    SenderMon = erlang:monitor(process, Sender),
    InboxMon = erlang:monitor(process, Dest),
    keeper_loop(Ref, Reply, SenderMon, InboxMon).

keeper_loop(Ref, Reply, SenderMon, InboxMon) ->
    receive
        {Ref, convoy_piece, delivered} ->
            Reply ! {Reply, convoy_piece, delivered};
        {Ref, convoy_piece, Answer} ->
            Reply ! {Reply, convoy_piece, Answer},
            keeper_loop(Ref, Reply, SenderMon, InboxMon);
        {'DOWN', InboxMon, process, _, _} ->
            Reply ! {Reply, convoy_piece_down};
        {'DOWN', SenderMon, process, _, _} ->
            ok
    end.

%% End of the wait, with local signals only. A message delivered, or on its way
%% (`sent'), keeps its keeper until the inbox has it; any other is given up.
%% Nothing sent to Reply reaches the sender after `unalias/1'; what came before
%% is flushed.
release(Keeper, Reply, Result) ->
    _ = Result =:= delivered orelse Result =:= sent orelse exit(Keeper, kill),
    true = unalias(Reply),
    flush(Reply).

flush(Reply) ->
    receive
        {Reply, convoy_piece, _} -> flush(Reply);
        {Reply, convoy_piece_down} -> flush(Reply)
    after 0 ->
        ok
    end.

%% A peer at version 3 is asked to acknowledge every `chunk_window div 2'
%% pieces (each answer covers the pieces before it): half the answers, each a
%% distribution message both nodes handle, and the window opens by half at a
%% time. Any `chunk_window' pieces in a row hold one that is acknowledged, or the
%% last piece, after which the sender waits for `delivered' instead: it never
%% waits for an answer that is not coming.
start(#runtime{chunk_window = W}, Vsn, {Ref, _Reply}, Keeper, To, Kind, Size, First) ->
    case convoy_wire:supports(Vsn, piece_acks) of
        true -> convoy_wire:piece_start(Ref, Keeper, To, Kind, Size, max(1, W div 2), First);
        false -> convoy_wire:piece_start(Ref, Keeper, To, Kind, Size, First)
    end.

first(RT, Dest, Ids, C, Start, Rest) ->
    case put_piece(RT, Dest, Start) of
        ok ->
            case await(RT, Ids, C) of
                {ack, 0} ->
                    convoy_metrics:add(C, chunked, 1),
                    stream(RT, Dest, Ids, C, 1, Rest, 0, true);
                delivered when Rest =:= [] ->
                    %% one piece: complete at once
                    convoy_metrics:add(C, chunked, 1),
                    delivered;
                refused ->
                    refused;
                timeout when Rest =:= [] ->
                    %% The whole message was that piece: it is on its way.
                    convoy_metrics:add(C, chunked, 1),
                    convoy_metrics:add(C, stalled, 1),
                    sent;
                timeout ->
                    %% Never completed: the inbox drops it when its keeper goes.
                    convoy_metrics:add(C, stalled, 1),
                    no_answer;
                _DownOrUnexpected ->
                    dropped
            end;
        dropped ->
            dropped
    end.

%% Pieces Seq.. left; Acked: the highest piece acked; Paced: false once the
%% receiver has been silent too long.
stream(RT, _Dest, Ids, C, _Seq, [], _Acked, _Paced) ->
    finish(RT, Ids, C);
stream(RT = #runtime{chunk_window = W}, Dest, Ids, C, Seq, [P | Ps] = Pieces, Acked, Paced) ->
    case (not Paced) orelse Seq - 1 - Acked < W of
        true ->
            case put_piece(RT, Dest, convoy_wire:piece(element(1, Ids), Seq, P)) of
                ok -> stream(RT, Dest, Ids, C, Seq + 1, Ps, Acked, Paced);
                dropped -> dropped
            end;
        false ->
            case await(RT, Ids, C) of
                {ack, A} ->
                    stream(RT, Dest, Ids, C, Seq, Pieces, max(A, Acked), Paced);
                timeout ->
                    convoy_metrics:add(C, stalled, 1),
                    stream(RT, Dest, Ids, C, Seq, Pieces, Acked, false);
                _DownOrUnexpected ->
                    dropped
            end
    end.

%% Everything is handed over: wait for the delivery (acks still arriving count as
%% progress).
finish(RT, Ids, C) ->
    case await(RT, Ids, C) of
        delivered ->
            delivered;
        {ack, _} ->
            finish(RT, Ids, C);
        timeout ->
            convoy_metrics:add(C, stalled, 1),
            sent;
        _DownOrUnexpected ->
            sent
    end.

%% A wait for the inbox's answer: its time counts in the node's `waited_us', as
%% a barrier's does (`convoy_wait').
await(#runtime{barrier_timeout = T}, {_Ref, Reply}, C) ->
    T0 = erlang:monotonic_time(),
    Answer = receive
                 {Reply, convoy_piece, Seq} when is_integer(Seq) -> {ack, Seq};
                 {Reply, convoy_piece, delivered} -> delivered;
                 {Reply, convoy_piece, refused} -> refused;
                 {Reply, convoy_piece_down} -> down
             after T ->
                 timeout
             end,
    convoy_metrics:add(C, waited_us, erlang:convert_time_unit(erlang:monotonic_time() - T0,
                                                              native, microsecond)),
    Answer.

%% One piece as a batch of one, never suspending the sender: when the
%% connection is busy, a helper process makes the send (suspended, as `!' would
%% be, until the connection takes it) while the sender waits for it at most
%% block_timeout ms; the sender goes on only once the piece is in the connection,
%% so pieces keep their order. The helper is local: spawning, monitoring and
%% killing it never wait for the connection.
put_piece(#runtime{block_timeout = BT}, Dest, Entry) ->
    Batch = convoy_wire:batch(node(), [Entry]),
    case erlang:send(Dest, Batch, ?SEND_OPTS) of
        ok -> ok;
        noconnect -> dropped;
        nosuspend -> busy_send(Dest, Batch, BT)
    end.

busy_send(Dest, Batch, Timeout) ->
    Self = self(),
    Tag = make_ref(),
    {Pid, Mon} = spawn_monitor(fun() ->
                                       Result = erlang:send(Dest, Batch, [noconnect]),
                                       Self ! {Tag, Result}
                               end),
    receive
        {Tag, ok} ->
            erlang:demonitor(Mon, [flush]),
            ok;
        {Tag, noconnect} ->
            erlang:demonitor(Mon, [flush]),
            dropped;
        {'DOWN', Mon, process, Pid, _} ->
            dropped
    after Timeout ->
        %% Killed while suspended, the helper has not handed the piece over.
        exit(Pid, kill),
        receive
            {'DOWN', Mon, process, Pid, _} -> ok
        end,
        receive
            {Tag, ok} -> ok;
            {Tag, noconnect} -> dropped
        after 0 ->
            dropped
        end
    end.
