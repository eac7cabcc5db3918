%% @private
%% The inbox's side of messages sent in pieces: runs in a `convoy_inbox' process
%% and carries out `convoy_chunk''s reassembly decisions (acks, monitors, counts).
%%
%% The reassembly state lives in the inbox's process dictionary (one key,
%% `?KEY'), because the inbox's delivery walk over a batch threads no state of its
%% own; only this module reads or writes it. A piece is delivered in the inbox's
%% order: the completed message goes out at the position of its last piece, so it
%% keeps its place among the rest of its sender's traffic through this inbox.
%%
%% The sender of a message in progress is monitored: if it dies (or its node goes
%% down) the partial message is discarded and counted (`partial_discarded'); a
%% `DOWN' counts only with the monitor kept for that message, so a stray one
%% naming a sender discards nothing. A
%% piece that does not fit the state (forged, out of sequence, repeated, past its
%% size) is `bad_piece'; a start over `max_reassembly_bytes' for its node is
%% answered `refused' and counted (`reassembly_full'): its sender then sends the
%% message whole. The bound is the node's, whichever inboxes its partials are
%% in: `convoy_chunk' decides a start against the room the node's other inboxes
%% leave this one, and `convoy_chunk_bound' keeps the inboxes' reservations.
%%
%% A node's messages in pieces take turns (`convoy_chunk', "Turns"): a start's
%% acknowledgement may wait for its turn, which this module sends when
%% `convoy_chunk' grants it. While partial messages are held, a timer
%% (`erlang:start_timer/3', its reference kept beside the state) brings a tick
%% every `?TICK_MS' ms, and a start waits at most half of `barrier_timeout'
%% (this node's) in all, so its sender, which gives up after `barrier_timeout',
%% gets its turn first.
%%
%% A sender that gave up on its message (its turn came too late and it sent the
%% message whole, or it stopped part way) stays alive and sends no more pieces
%% of it: at each tick the processes that monitor the inbox
%% (`process_info/2', `monitored_by') and the nodes whose batches the inbox has
%% not handled in full go to `convoy_chunk:sweep/3', which discards such a
%% partial once its sender no longer monitors the inbox (see there why that is
%% sound). The next tick's timer is set after the sweep, so its message comes
%% after everything the inbox had received at the sweep.
-module(convoy_chunk_rx).

-export([init/2, handle/2, delivered/1, down/2, nodedown/1, tick/2, held/2, partials/1]).

-include("convoy_runtime.hrl").

-define(KEY, '$convoy_chunks').
-define(TIMER_KEY, '$convoy_chunk_timer').
%% The timer's message is `{timeout, TRef, ?TICK}' (convoy_inbox passes it to
%% `tick/1').
-define(TICK, convoy_chunk_tick).
-define(TICK_MS, 10).
-define(ACK_OPTS, [noconnect]).

%% The state after a change: give back the room of partials gone, acknowledge
%% the starts whose turn came, and keep a tick coming while partial messages are
%% held.
store(Rx0) ->
    {Granted, Rx} = convoy_chunk:take_granted(Rx0),
    put(?KEY, Rx),
    lists:foreach(fun(N) -> convoy_chunk_bound:release(N, convoy_chunk:held(N, Rx)) end,
                  convoy_chunk_bound:nodes()),
    lists:foreach(fun(Ref) -> ack(Ref, 0) end, Granted),
    case convoy_chunk:partials(Rx) > 0 andalso get(?TIMER_KEY) =:= undefined of
        true -> put(?TIMER_KEY, erlang:start_timer(?TICK_MS, self(), ?TICK));
        false -> ok
    end,
    ok.

rx() ->
    case get(?KEY) of
        undefined -> convoy_chunk:new();
        Rx -> Rx
    end.

%% @doc The calling process is inbox `Index' of `Inboxes', (re)started: it holds
%% no partial message.
-spec init(pos_integer(), pos_integer()) -> ok.
init(Index, Inboxes) ->
    convoy_chunk_bound:join(Index, Inboxes).

%% @doc A checked piece entry from `From'. `{deliver, To, Msg, Ref}' when it
%% completed a message (deliver it, then call `delivered(Ref)'), else `none'.
-spec handle({piece_start, map()} | {piece, reference(), pos_integer(), binary()}, node()) ->
          {deliver, term(), term(), reference()} | none.
handle({piece_start, St = #{ref := Ref, sender := Sender}}, From) ->
    Mon = erlang:monitor(process, Sender),
    {R, Dropped, Rx} = start(From, St#{mon => Mon}, rx()),
    store(Rx),
    discarded(Dropped),
    case R of
        {ack, _} -> ok;
        stored -> ok;       % waits for its turn
        _ -> erlang:demonitor(Mon, [flush])
    end,
    result(R, Ref, From);
handle({piece, Ref, Seq, Data}, From) ->
    {R, Rx} = convoy_chunk:piece(From, Ref, Seq, Data, rx()),
    store(Rx),
    result(R, Ref, From).

%% A start decided against the room the node's other inboxes leave, and refused
%% after all if one of them took that room meanwhile (`convoy_chunk_bound').
start(Node, St, Rx0) ->
    Bound = bound(),
    Held0 = convoy_chunk:held(Node, Rx0),
    {_, _, Rx} = Result = convoy_chunk:start(Node, St, convoy_chunk_bound:room(Node, Bound), Rx0),
    Held = convoy_chunk:held(Node, Rx),
    case Held =< Held0 orelse convoy_chunk_bound:reserve(Node, Held, Bound) of
        true -> Result;
        false -> convoy_chunk:start(Node, St, 0, Rx0)
    end.

result({ack, Seq}, Ref, _From) ->
    ack(Ref, Seq),
    none;
result(stored, _Ref, _From) ->
    none;
result({complete, Kind, To, Parts, Mon}, Ref, From) ->
    erlang:demonitor(Mon, [flush]),
    case convoy_chunk:assemble(Kind, Parts) of
        {ok, Msg} ->
            %% The message passes the checks a batch entry passes (a message that
            %% is itself a batch would make the inbox feed itself).
            case convoy_wire:entry({To, Msg}, From, node()) of
                {deliver, To, Msg} ->
                    {deliver, To, Msg, Ref};
                {error, Kind1} ->
                    convoy_metrics:rejected(Kind1),
                    delivered(Ref),
                    none
            end;
        error ->
            convoy_metrics:rejected(bad_piece),
            delivered(Ref),
            none
    end;
result(refused, Ref, _From) ->
    convoy_metrics:rejected(reassembly_full),
    _ = erlang:send(Ref, {Ref, convoy_piece, refused}, ?ACK_OPTS),
    none;
result({error, bad_piece}, _Ref, _From) ->
    convoy_metrics:rejected(bad_piece),
    none.

ack(Ref, Seq) ->
    _ = erlang:send(Ref, {Ref, convoy_piece, Seq}, ?ACK_OPTS),
    ok.

%% @doc Tell the sender its message was delivered (or rejected whole): it may send
%% its next messages directly.
-spec delivered(reference()) -> ok.
delivered(Ref) ->
    _ = erlang:send(Ref, {Ref, convoy_piece, delivered}, ?ACK_OPTS),
    ok.

%% @doc The monitor `Mon' of a sender `Pid' fired: its partial message is
%% discarded. False when `Mon' is not the monitor this inbox keeps for a message
%% in progress from `Pid' (the caller decides what such a `DOWN' is).
-spec down(reference(), pid()) -> boolean().
down(Mon, Pid) ->
    {Mons, Rx} = convoy_chunk:down(Pid, Mon, rx()),
    store(Rx),
    discarded(Mons),
    Mons =/= [].

%% @doc `Node' went down: its partial messages are discarded.
-spec nodedown(node()) -> ok.
nodedown(Node) ->
    {Mons, Rx} = convoy_chunk:nodedown(Node, rx()),
    store(Rx),
    discarded(Mons),
    convoy_chunk_bound:forget(Node).

discarded(Mons) ->
    lists:foreach(fun(M) ->
                          erlang:demonitor(M, [flush]),
                          convoy_metrics:rejected(partial_discarded)
                  end, Mons).

%% @doc A message `{timeout, TRef, convoy_chunk_tick}' came: if `TRef' is the
%% tick's timer, partials of senders that moved on are discarded and starts
%% waiting for their turn are served (true); otherwise it is not convoy's
%% (false: the caller counts it). `Busy': the nodes whose batches the inbox has
%% not handled in full.
-spec tick(reference(), [node()]) -> boolean().
tick(TRef, Busy) ->
    case get(?TIMER_KEY) of
        TRef ->
            erase(?TIMER_KEY),
            {monitored_by, Watching} = erlang:process_info(self(), monitored_by),
            {Mons, Rx} = convoy_chunk:sweep(Watching, Busy, rx()),
            discarded(Mons),
            store(convoy_chunk:tick(patience(), Rx)),
            true;
        _ ->
            false
    end.

%% Ticks a start waits at most: half of barrier_timeout.
patience() ->
    T = case persistent_term:get(?RUNTIME_KEY, undefined) of
            #runtime{barrier_timeout = B} -> B;
            undefined -> maps:get(barrier_timeout, convoy_config:defaults())
        end,
    max(1, T div (2 * ?TICK_MS)).

%% @doc Bytes reserved for partial messages from `Node' in the inbox `Inbox'
%% (for tests and inspection: reads its process dictionary); in all inboxes:
%% `convoy_chunk_bound:reserved/1'.
-spec held(pid(), node()) -> non_neg_integer().
held(Inbox, Node) -> convoy_chunk:held(Node, rx_of(Inbox)).

%% @doc Partial messages held in the inbox `Inbox'.
-spec partials(pid()) -> non_neg_integer().
partials(Inbox) -> convoy_chunk:partials(rx_of(Inbox)).

rx_of(Inbox) ->
    {dictionary, D} = erlang:process_info(Inbox, dictionary),
    case lists:keyfind(?KEY, 1, D) of
        {?KEY, Rx} -> Rx;
        false -> convoy_chunk:new()
    end.

%% The per-node bound in force, for all inboxes together (the default while
%% convoy's runtime is not published).
bound() ->
    case persistent_term:get(?RUNTIME_KEY, undefined) of
        #runtime{max_reassembly_bytes = B} -> B;
        undefined -> maps:get(max_reassembly_bytes, convoy_config:defaults())
    end.
