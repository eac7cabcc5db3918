%% @private
%% Chunked large messages: cutting a message into pieces on the sender, and the
%% receiver's reassembly state. Pure.
%%
%% A message at or above `chunk_threshold' (its encoded size) travels as pieces
%% of `chunk_bytes', sent by its sender to its lane's inbox on the peer, at most
%% `chunk_window' of them unacknowledged (`convoy_chunk_send'), so other traffic to
%% that node travels between the pieces instead of waiting behind one long copy.
%%
%% Sender: `payload/2' gives the bytes to cut. A binary message is cut as it is
%% (no encoding, no copy: the pieces are sub-binaries of it); any other term is
%% encoded once with `term_to_iovec/1', whose large binaries are referenced, not
%% copied. `pieces/2' cuts that iodata into pieces: sub-binaries, except where a
%% piece spans two elements of the iovec (one piece-sized copy).
%%
%% Receiver copies: the pieces arrive as binaries of their own; the completed
%% message is joined once (`iolist_to_binary/1', one copy of its bytes) and, for a
%% term, decoded once (`binary_to_term/1', which copies the binaries in it once
%% more). Both are built-in functions that yield, so they do not hold a scheduler.
%%
%% A binary carried in tuples (kind `path', protocol version 3): most large
%% messages are a small envelope around one large binary (`{Pid, Binary}', a
%% cast's `{'$gen_cast', {put, Key, Binary}}'). When the
%% largest binary of a message sits at most `?PATH_DEPTH' tuples deep, in tuples
%% of at most `?PATH_WIDTH' elements, and has at least `?PATH_BYTES' bytes, the
%% bytes cut are the rest of the message encoded (its skeleton, with `<<>>' in the
%% binary's place) followed by the binary's own bytes. The receiver joins them
%% (one copy), decodes only the skeleton and puts a part of the joined bytes in
%% the binary's place: the binary is not copied a second time by decoding.
%%
%% Reassembly state (`rx()'): partial messages keyed by the sender's reference
%% (an alias, fresh per message), one per sender pid at a time. A start piece
%% names the sender, the destination, the kind (`binary', `term' or `path') and
%% the total size; pieces then come with sequence numbers 1, 2, ... and the message is
%% complete when the bytes received reach the size. A start reserves its whole
%% size against the per-node bound (in this state: what the node's partials
%% elsewhere, in other inboxes, leave of it): a start that does not fit is
%% refused (the sender then sends the message whole, see `convoy_chunk_send'),
%% so the bytes held for partial messages of one node never exceed the bound.
%% Rejected (never
%% stored, never delivered): a piece of an unknown message, a piece out of
%% sequence or repeated, a piece that would pass the announced size, an empty
%% piece, a second start for a message in progress, and a start of a message
%% completed recently (the last `?DONE_KEEP' are remembered), so nothing is
%% delivered twice. A new start from a sender that has a message in progress
%% discards that one (the sender gave up on it). `down/3' (only with the monitor
%% kept with the partial) and `nodedown/2' discard a dead sender's or node's
%% partial messages.
%%
%% A node's messages take turns (see "Turns" below): one streams while the
%% acknowledgements of the other starts wait, so the node does not hold the
%% pieces of all of them at once. A message whose sender moved on is discarded
%% (see "Senders that moved on" below), so its reservation does not outlive it.
-module(convoy_chunk).

-export([payload/2, pieces/2, new/0, start/4, piece/5, down/3, nodedown/2, held/2, held/1,
         partials/1, assemble/2, take_granted/1, waiting/1, tick/2, sweep/3]).

-export_type([rx/0, kind/0, start/0, result/0]).

-include("convoy_limits.hrl").

%% Completed messages remembered against replays.
-define(DONE_KEEP, 4096).

%% Where a message's large binary is looked for (kind `path'): tuples at most
%% `?PATH_DEPTH' deep (convoy_limits.hrl: the depth a receiver accepts), of at
%% most this many elements (so the search visits at most 16^3 elements), and a
%% binary at least this large (under it, decoding's copy is cheap and the
%% message is encoded whole).
-define(PATH_WIDTH, 16).
-define(PATH_BYTES, 65536).

%% `{path, Path, SkeletonBytes}': the message is its skeleton (the first
%% SkeletonBytes bytes, encoded) with the rest of the bytes, a binary, put at Path
%% (tuple indices, outermost first).
-type kind() :: binary | term | {path, [pos_integer(), ...], non_neg_integer()}.
%% What a start piece says: reference, sender, destination, kind, size, mon (an
%% opaque term the caller keeps with the partial: its monitor), first data, and
%% how often the sender wants an acknowledgement (every piece if absent).
-type start() :: #{ref := reference(), sender := pid(), to := term(), kind := kind(),
                   size := pos_integer(), mon := term(), data := binary(),
                   ack_every => pos_integer()}.
-record(partial, {node :: node(),
                  sender :: pid(),
                  to :: term(),
                  kind :: kind(),
                  size :: pos_integer(),
                  ack_every :: pos_integer(),
                  mon :: term(),
                  got :: non_neg_integer(),
                  next :: non_neg_integer(),
                  parts :: [binary()],         % newest first
                  %% its sender was seen no longer monitoring the inbox
                  left = false :: boolean()}).
-record(rx, {partials = #{} :: #{reference() => #partial{}},
             senders = #{} :: #{pid() => reference()},
             held = #{} :: #{node() => non_neg_integer()},
             done = queue:new() :: queue:queue(reference()),
             done_set = #{} :: #{reference() => true},
             %% per node, the message whose sender may stream now, with its
             %% next sequence number at the last tick (`fresh' until a tick
             %% after its grant)
             active = #{} :: #{node() => {reference(), non_neg_integer() | fresh}},
             %% per node, started messages whose first acknowledgement waits,
             %% oldest first, with the ticks they waited
             queued = #{} :: #{node() => [{reference(), non_neg_integer()}, ...]},
             %% granted since `take_granted/1', newest first
             granted = [] :: [reference()]}).
-opaque rx() :: #rx{}.
%% `{ack, Seq}': stored, acknowledge it (and the pieces before it); `stored':
%% stored, no acknowledgement asked for this one (the start's `ack_every': the
%% start and every piece whose Seq rem ack_every is ack_every - 1 are
%% acknowledged), or a start whose acknowledgement waits for its turn
%% (`take_granted/1' names it when it comes); `{complete, Kind, To, Parts,
%% Mon}': the message is whole (`assemble/2' it); `refused': the start does not fit the bound (nothing kept);
%% `{error, bad_piece}': rejected, nothing kept. `start/4' also returns the
%% monitors of partials it discarded (the sender's previous message).
-type result() :: {ack, non_neg_integer()}
                | stored
                | {complete, kind(), term(), [binary()], term()}
                | refused
                | {error, bad_piece}.

%%--------------------------------------------------------------------
%% Sender

%% @doc The kind and the bytes to cut: a binary as it is; with `Paths' (the peer
%% reads kind `path'), a message whose large binary sits in tuples near its top
%% as its skeleton and that binary (see the module's header); any other term
%% encoded once (`term_to_iovec/1': large binaries in it are referenced, not
%% copied).
-spec payload(term(), boolean()) -> {kind(), iodata()}.
payload(Msg, _Paths) when is_binary(Msg) ->
    {binary, Msg};
payload(Msg, true) when is_tuple(Msg) ->
    case largest(Msg, ?PATH_DEPTH) of
        {Path, Bin} when byte_size(Bin) >= ?PATH_BYTES ->
            Skeleton = erlang:term_to_iovec(put_at(Path, Msg, <<>>)),
            {{path, Path, iolist_size(Skeleton)}, [Skeleton, Bin]};
        _ ->
            {term, erlang:term_to_iovec(Msg)}
    end;
payload(Msg, _Paths) ->
    {term, erlang:term_to_iovec(Msg)}.

%% The largest binary among a tuple's elements and, within the depth, those of
%% the tuples in it: `{Path, Binary}' or `none'.
largest(T, Depth) when is_tuple(T), Depth > 0, tuple_size(T) =< ?PATH_WIDTH ->
    largest(T, 1, Depth, none);
largest(_T, _Depth) ->
    none.

largest(T, I, _Depth, Best) when I > tuple_size(T) ->
    Best;
largest(T, I, Depth, Best) ->
    Found = case element(I, T) of
                B when is_binary(B) ->
                    {[I], B};
                E ->
                    case largest(E, Depth - 1) of
                        {P, B} -> {[I | P], B};
                        none -> none
                    end
            end,
    largest(T, I + 1, Depth, larger(Found, Best)).

larger(none, Best) -> Best;
larger(Found, none) -> Found;
larger({_, B} = Found, {_, Best}) when byte_size(B) > byte_size(Best) -> Found;
larger(_Found, Best) -> Best.

put_at([I], T, V) -> setelement(I, T, V);
put_at([I | Path], T, V) -> setelement(I, T, put_at(Path, element(I, T), V)).

%% @doc `{Size, Pieces}': `Data' cut into pieces of `PieceBytes' (the last one
%% shorter), in order; their concatenation is `Data'.
-spec pieces(iodata(), pos_integer()) -> {non_neg_integer(), [binary()]}.
pieces(Data, PieceBytes) when is_binary(Data) ->
    {byte_size(Data), cut(Data, PieceBytes)};
pieces(Data, PieceBytes) ->
    Bins = flatten(Data, []),
    {lists:sum([byte_size(B) || B <- Bins]), join_cut(Bins, PieceBytes, [], 0, [])}.

cut(Bin, N) when byte_size(Bin) =< N ->
    [Bin || byte_size(Bin) > 0];
cut(Bin, N) ->
    <<P:N/binary, Rest/binary>> = Bin,
    [P | cut(Rest, N)].

%% The binaries of an iolist, in order (term_to_iovec gives a flat list already).
flatten([], Acc) -> lists:reverse(Acc);
flatten([B | T], Acc) when is_binary(B) -> flatten(T, [B | Acc]);
flatten([L | T], Acc) when is_list(L) -> flatten(T, lists:reverse(flatten(L, []), Acc));
flatten([C | T], Acc) when is_integer(C) -> flatten(T, [<<C>> | Acc]);
flatten(B, Acc) when is_binary(B) -> lists:reverse([B | Acc]).

%% Cur: parts of the piece being filled (newest first), CurN its bytes.
join_cut([], _N, Cur, CurN, Out) ->
    lists:reverse(close_piece(Cur, CurN, Out));
join_cut([B | Rest], N, Cur, CurN, Out) ->
    Room = N - CurN,
    case byte_size(B) of
        0 ->
            join_cut(Rest, N, Cur, CurN, Out);
        S when S < Room ->
            join_cut(Rest, N, [B | Cur], CurN + S, Out);
        _ ->
            <<Fill:Room/binary, Tail/binary>> = B,
            Out1 = close_piece([Fill | Cur], N, Out),
            Whole = cut(Tail, N),
            case Whole =/= [] andalso byte_size(lists:last(Whole)) < N of
                true ->
                    Last = lists:last(Whole),
                    join_cut(Rest, N, [Last], byte_size(Last),
                             lists:reverse(lists:droplast(Whole), Out1));
                false ->
                    join_cut(Rest, N, [], 0, lists:reverse(Whole, Out1))
            end
    end.

close_piece(_Cur, 0, Out) -> Out;
close_piece([B], _N, Out) -> [B | Out];
close_piece(Cur, _N, Out) -> [iolist_to_binary(lists:reverse(Cur)) | Out].

%%--------------------------------------------------------------------
%% Receiver

-spec new() -> rx().
new() -> #rx{}.

%% @doc A start piece from `Node', with `Bound' the bytes of partial messages of
%% `Node' this state may hold (the node's bound less what its partials elsewhere
%% reserve). Returns the result and the monitors of partials it discarded (this
%% sender's unfinished previous message).
-spec start(node(), start(), non_neg_integer() | infinity, rx()) ->
          {result(), [term()], rx()}.
start(Node, #{ref := Ref, sender := Sender, size := Size, data := Data} = St, Bound, Rx)
  when is_integer(Size), Size > 0, byte_size(Data) > 0, byte_size(Data) =< Size ->
    case is_map_key(Ref, Rx#rx.partials) orelse is_map_key(Ref, Rx#rx.done_set) of
        true ->
            {{error, bad_piece}, [], Rx};
        false ->
            {Dropped, Rx1} = case Rx#rx.senders of
                                 #{Sender := Old} -> drop(Old, Rx);
                                 _ -> {[], Rx}
                             end,
            Held = maps:get(Node, Rx1#rx.held, 0),
            case fits(Held + Size, Bound) of
                false ->
                    {refused, Dropped, Rx1};
                true ->
                    P = #partial{node = Node, sender = Sender, to = maps:get(to, St),
                                 kind = maps:get(kind, St), size = Size,
                                 ack_every = maps:get(ack_every, St, 1),
                                 mon = maps:get(mon, St), got = 0, next = 0, parts = []},
                    Rx2 = Rx1#rx{held = (Rx1#rx.held)#{Node => Held + Size},
                                 senders = (Rx1#rx.senders)#{Sender => Ref}},
                    {R, Rx3} = add(Ref, P, 0, Data, Rx2),
                    {R1, Rx4} = take_turn(Node, Ref, R, Rx3),
                    {R1, Dropped, Rx4}
            end
    end;
start(_Node, _St, _Bound, Rx) ->
    {{error, bad_piece}, [], Rx}.

fits(_Bytes, infinity) -> true;
fits(Bytes, Bound) -> Bytes =< Bound.

%% @doc Piece `Seq' (1, 2, ...) of the message `Ref', from `Node'.
-spec piece(node(), reference(), pos_integer(), binary(), rx()) -> {result(), rx()}.
piece(Node, Ref, Seq, Data, Rx) ->
    case Rx#rx.partials of
        #{Ref := P = #partial{node = Node}} -> add(Ref, P, Seq, Data, Rx);
        _ -> {{error, bad_piece}, Rx}
    end.

add(Ref, P = #partial{next = Seq, got = Got, size = Size}, Seq, Data, Rx)
  when byte_size(Data) > 0, Got + byte_size(Data) =< Size ->
    Got1 = Got + byte_size(Data),
    Parts = [Data | P#partial.parts],
    case Got1 =:= Size of
        false ->
            P1 = P#partial{got = Got1, next = Seq + 1, parts = Parts},
            {acked(Seq, P#partial.ack_every), Rx#rx{partials = (Rx#rx.partials)#{Ref => P1}}};
        true ->
            Rx1 = remember(Ref, remove(Ref, P, Rx)),
            {{complete, P#partial.kind, P#partial.to, lists:reverse(Parts), P#partial.mon}, Rx1}
    end;
add(_Ref, _P, _Seq, _Data, Rx) ->
    {{error, bad_piece}, Rx}.

acked(0, _Every) -> {ack, 0};
acked(Seq, Every) when Seq rem Every =:= Every - 1 -> {ack, Seq};
acked(_Seq, _Every) -> stored.

remove(Ref, #partial{node = Node, sender = Sender, size = Size}, Rx) ->
    Held = maps:get(Node, Rx#rx.held) - Size,
    release(Node, Ref,
            Rx#rx{partials = maps:remove(Ref, Rx#rx.partials),
                  senders = maps:remove(Sender, Rx#rx.senders),
                  held = case Held of
                             0 -> maps:remove(Node, Rx#rx.held);
                             _ -> (Rx#rx.held)#{Node := Held}
                         end}).

%%--------------------------------------------------------------------
%% Turns: one message in pieces per node streams at a time
%%
%% Every piece is kept (as a part of the runtime's receive buffer) until its
%% message is whole, so senders streaming side by side make the node hold all
%% their messages at once, and with the runtime's default allocator settings
%% those buffers are then received into fresh pages (doc/design.md, messages in
%% pieces, "Turns"). So a node's messages take turns: a start that
%% comes while another message of its node streams is stored but its
%% acknowledgement, which its sender waits for before the next piece, waits
%% until that message is whole or discarded. Turns are kept only while they
%% make progress (`tick/2', every few ms while starts wait): a message that got
%% no piece between two ticks gives up its turn, and a start that waited
%% `Patience' ticks gets its acknowledgement anyway (the sender gives up after
%% `barrier_timeout' and sends the message whole). Nothing else changes: a
%% waiting message takes pieces and completes as any other.

%% A start that completed nothing takes the node's turn, or waits for it.
take_turn(Node, Ref, {ack, 0}, Rx = #rx{active = Active}) ->
    case Active of
        #{Node := _} ->
            {stored, Rx#rx{queued = set_queue(Node, maps:get(Node, Rx#rx.queued, []) ++ [{Ref, 0}],
                                              Rx#rx.queued)}};
        _ ->
            {{ack, 0}, Rx#rx{active = Active#{Node => {Ref, fresh}}}}
    end;
take_turn(_Node, _Ref, R, Rx) ->
    {R, Rx}.

%% A message left: its turn passes on, or it stops waiting for one.
release(Node, Ref, Rx = #rx{active = Active}) ->
    case Active of
        #{Node := {Ref, _}} ->
            grant_next(Node, Rx#rx{active = maps:remove(Node, Active)});
        _ ->
            Queue = lists:keydelete(Ref, 1, maps:get(Node, Rx#rx.queued, [])),
            Rx#rx{queued = set_queue(Node, Queue, Rx#rx.queued)}
    end.

grant_next(Node, Rx = #rx{queued = Queued}) ->
    case maps:get(Node, Queued, []) of
        [] ->
            Rx;
        [{Ref, _} | Rest] ->
            Rx#rx{queued = set_queue(Node, Rest, Queued),
                  active = (Rx#rx.active)#{Node => {Ref, fresh}},
                  granted = [Ref | Rx#rx.granted]}
    end.

set_queue(Node, [], Queued) -> maps:remove(Node, Queued);
set_queue(Node, Queue, Queued) -> Queued#{Node => Queue}.

%% @doc The messages whose start is now acknowledged (their turn came), oldest
%% first: the caller sends each its acknowledgement of piece 0.
-spec take_granted(rx()) -> {[reference()], rx()}.
take_granted(Rx = #rx{granted = []}) ->
    {[], Rx};
take_granted(Rx = #rx{granted = Granted, partials = Partials}) ->
    {[R || R <- lists:reverse(Granted), is_map_key(R, Partials)], Rx#rx{granted = []}}.

%% @doc Whether starts wait for their turn (then `tick/2' must come).
-spec waiting(rx()) -> boolean().
waiting(#rx{queued = Queued}) -> map_size(Queued) > 0.

%% @doc A tick, per node with waiting starts: the streaming message gives up
%% its turn if it took no piece since the last tick (one tick after its turn
%% came at the earliest: its sender needs the acknowledgement first, and the
%% tick may come right after the grant); every waiting start has waited one
%% tick more, and those that waited `Patience' ticks are granted; then a free
%% turn goes to the oldest start still waiting.
-spec tick(pos_integer(), rx()) -> rx().
tick(Patience, Rx) ->
    lists:foldl(fun(Node, Acc) -> tick(Node, Patience, Acc) end, Rx,
                lists:sort(maps:keys(Rx#rx.queued))).

tick(Node, Patience, Rx = #rx{active = Active}) ->
    Active1 = case Active of
                  #{Node := {Ref, Mark}} ->
                      case maps:get(Ref, Rx#rx.partials) of
                          #partial{next = Mark} -> maps:remove(Node, Active);
                          #partial{next = Next} -> Active#{Node := {Ref, Next}}
                      end;
                  _ ->
                      Active
              end,
    {Done, Waiting} = lists:partition(fun({_, W}) -> W >= Patience end,
                                      [{R, W + 1} || {R, W} <- maps:get(Node, Rx#rx.queued)]),
    Rx1 = Rx#rx{active = Active1, queued = set_queue(Node, Waiting, Rx#rx.queued),
                granted = lists:reverse([R || {R, _} <- Done], Rx#rx.granted)},
    case Active1 of
        #{Node := _} -> Rx1;
        _ -> grant_next(Node, Rx1)
    end.

%%--------------------------------------------------------------------
%% Senders that moved on
%%
%% A sender monitors the inbox while it works on a message (its acknowledgements
%% go to an alias that is that monitor, see `convoy_chunk_send'): from before
%% its start piece until it returns, whatever the outcome: delivered, its turn
%% waited for too long (it then sends the message whole), dropped on a busy
%% connection, or its last piece sent without an answer. Signals between two
%% processes keep their order, so once the inbox sees the sender without a
%% monitor on it, every piece the sender sent of that message has reached the
%% inbox's mailbox: if the message is not whole once those are handled, it
%% never will be. `sweep/3' marks such partials and, at the next sweep (when
%% everything received before the marking has been handled), discards those
%% still incomplete, unless their node's batches are not all handled yet. The
%% caller must call it with the processes monitoring the inbox now and the
%% nodes with batches not yet handled in full, and call it again only after
%% handling what had been received at the previous call (`convoy_inbox_core'
%% does so at its ticks). A sender still monitoring the inbox for another
%% reason only keeps its partial longer.

%% @doc Mark the partials whose sender is not among `Watching' (the processes
%% monitoring the inbox), and discard those marked at the previous sweep unless
%% their node is among `Busy' (nodes with batches not yet handled in full).
%% Returns the monitors of the partials discarded.
-spec sweep([term()], [node()], rx()) -> {[term()], rx()}.
sweep(Watching, Busy, Rx) ->
    W = maps:from_keys(Watching, true),
    B = maps:from_keys(Busy, true),
    maps:fold(fun(Ref, P, Acc) -> sweep(Ref, P, W, B, Acc) end, {[], Rx}, Rx#rx.partials).

sweep(Ref, #partial{left = true, node = Node}, _W, B, {Mons, Rx}) when not is_map_key(Node, B) ->
    {M, Rx1} = drop(Ref, Rx),
    {M ++ Mons, Rx1};
sweep(Ref, P = #partial{left = false, sender = Sender}, W, _B, {Mons, Rx})
  when not is_map_key(Sender, W) ->
    {Mons, Rx#rx{partials = (Rx#rx.partials)#{Ref := P#partial{left = true}}}};
sweep(_Ref, _P, _W, _B, Acc) ->
    Acc.

drop(Ref, Rx) ->
    P = maps:get(Ref, Rx#rx.partials),
    {[P#partial.mon], remove(Ref, P, Rx)}.

remember(Ref, Rx = #rx{done = Q, done_set = Set}) ->
    Q1 = queue:in(Ref, Q),
    Set1 = Set#{Ref => true},
    case map_size(Set1) > ?DONE_KEEP of
        true ->
            {{value, Old}, Q2} = queue:out(Q1),
            Rx#rx{done = Q2, done_set = maps:remove(Old, Set1)};
        false ->
            Rx#rx{done = Q1, done_set = Set1}
    end.

%% @doc The monitor `Mon' of the sender `Pid' fired: its partial message is
%% discarded. Returns the monitors of the partials discarded: none when `Mon' is
%% not the monitor kept with `Pid''s partial (a stray `DOWN' changes nothing).
-spec down(pid(), term(), rx()) -> {[term()], rx()}.
down(Pid, Mon, Rx) ->
    case Rx#rx.senders of
        #{Pid := Ref} ->
            case maps:get(Ref, Rx#rx.partials) of
                #partial{mon = Mon} -> drop(Ref, Rx);
                _ -> {[], Rx}
            end;
        _ ->
            {[], Rx}
    end.

%% @doc `Node' is gone: its partial messages are discarded (their monitors).
-spec nodedown(node(), rx()) -> {[term()], rx()}.
nodedown(Node, Rx) ->
    Refs = [R || {R, #partial{node = N}} <- maps:to_list(Rx#rx.partials), N =:= Node],
    lists:foldl(fun(R, {Mons, Acc}) ->
                        {M, Acc1} = drop(R, Acc),
                        {M ++ Mons, Acc1}
                end, {[], Rx}, Refs).

%% @doc Bytes reserved by partial messages of `Node'.
-spec held(node(), rx()) -> non_neg_integer().
held(Node, Rx) -> maps:get(Node, Rx#rx.held, 0).

%% @doc Bytes reserved by partial messages, per node that has any.
-spec held(rx()) -> #{node() => pos_integer()}.
held(Rx) -> Rx#rx.held.

%% @doc How many partial messages are held.
-spec partials(rx()) -> non_neg_integer().
partials(Rx) -> map_size(Rx#rx.partials).

%% @doc The message of a completed one: `{ok, Msg}', or `error' when a term does
%% not decode or a skeleton has no `<<>>' at its path (forged bytes). The binary
%% of a `path' message is a part of the joined bytes, not a copy.
-spec assemble(kind(), [binary()]) -> {ok, term()} | error.
assemble(binary, [Bin]) -> {ok, Bin};
assemble(binary, Parts) -> {ok, iolist_to_binary(Parts)};
assemble(term, Parts) ->
    try {ok, binary_to_term(iolist_to_binary(Parts))}
    catch error:badarg -> error
    end;
assemble({path, Path, SkeletonBytes}, Parts) ->
    case iolist_to_binary(Parts) of
        <<Skeleton:SkeletonBytes/binary, Bin/binary>> ->
            try
                {ok, put_checked(Path, binary_to_term(Skeleton), Bin)}
            catch
                error:_ -> error
            end;
        _Shorter ->
            error
    end.

%% put_at/3 where the skeleton holds <<>> (fails otherwise).
put_checked([I], T, V) when element(I, T) =:= <<>> -> setelement(I, T, V);
put_checked([I | Path], T, V) when Path =/= [] ->
    setelement(I, T, put_checked(Path, element(I, T), V)).

-ifdef(TEST).
-include_lib("eunit/include/eunit.hrl").

pieces_binary_test() ->
    B = list_to_binary(lists:seq(0, 255)),
    {256, Ps} = pieces(B, 100),
    ?assertEqual([100, 100, 56], [byte_size(P) || P <- Ps]),
    ?assertEqual(B, iolist_to_binary(Ps)),
    ?assertEqual({0, []}, pieces(<<>>, 10)),
    ?assertEqual({10, [<<0:80>>]}, pieces(<<0:80>>, 10)).

pieces_iovec_test() ->
    Big = binary:copy(<<"ab">>, 100000),
    Msg = {self(), Big, #{k => [1, 2, 3]}, <<"tail">>},
    {term, Io} = payload(Msg, false),
    [begin
         {Size, Ps} = pieces(Io, N),
         ?assertEqual(iolist_size(Io), Size),
         ?assert(lists:all(fun(P) -> byte_size(P) =:= N end, lists:droplast(Ps))),
         ?assert(byte_size(lists:last(Ps)) =< N),
         ?assertEqual(Msg, binary_to_term(iolist_to_binary(Ps)))
     end || N <- [1, 7, 1000, 65536, 200001, 300000]].

rx_flow_test() ->
    Ref = make_ref(),
    S = self(),
    {{ack, 0}, [], Rx1} = start(n, #{ref => Ref, sender => S, to => t, kind => binary,
                                     size => 5, mon => m, data => <<"ab">>}, 10, new()),
    ?assertEqual(5, held(n, Rx1)),
    ?assertMatch({{error, bad_piece}, _}, piece(n, Ref, 2, <<"c">>, Rx1)),
    ?assertMatch({{error, bad_piece}, _}, piece(o, Ref, 1, <<"c">>, Rx1)),
    ?assertMatch({{error, bad_piece}, _}, piece(n, Ref, 1, <<"cdef">>, Rx1)),
    {{ack, 1}, Rx2} = piece(n, Ref, 1, <<"c">>, Rx1),
    {{complete, binary, t, Parts, m}, Rx3} = piece(n, Ref, 2, <<"de">>, Rx2),
    ?assertEqual({ok, <<"abcde">>}, assemble(binary, Parts)),
    ?assertEqual(0, held(n, Rx3)),
    ?assertEqual(0, partials(Rx3)),
    %% a replayed start is not a new message
    ?assertMatch({{error, bad_piece}, [], _},
                 start(n, #{ref => Ref, sender => S, to => t, kind => binary, size => 5,
                            mon => m, data => <<"abcde">>}, 10, Rx3)).

rx_bound_and_replace_test() ->
    S = self(),
    St = fun(R, Size) -> #{ref => R, sender => S, to => t, kind => binary, size => Size,
                           mon => R, data => <<"a">>} end,
    R1 = make_ref(),
    ?assertMatch({refused, [], _}, start(n, St(R1, 11), 10, new())),
    {{ack, 0}, [], Rx1} = start(n, St(R1, 6), 10, new()),
    %% the same sender starts again: the old one is discarded
    R2 = make_ref(),
    {{ack, 0}, [R1], Rx2} = start(n, St(R2, 10), 10, Rx1),
    ?assertEqual(10, held(n, Rx2)),
    ?assertMatch({{error, bad_piece}, _}, piece(n, R1, 1, <<"b">>, Rx2)),
    %% only the monitor kept with the partial discards it
    ?assertMatch({[], _}, down(S, R1, Rx2)),
    {[R2], Rx3} = down(S, R2, Rx2),
    ?assertEqual(0, held(n, Rx3)),
    {{ack, 0}, [], Rx4} = start(n, St(make_ref(), 3), 10, Rx3),
    {[_], Rx5} = nodedown(n, Rx4),
    ?assertEqual(0, partials(Rx5)).

path_test() ->
    Big = binary:copy(<<"xy">>, 40000),
    Msg = {self(), {tag, Big, <<"small">>}, #{k => v}},
    {{path, [2, 2], SkelBytes} = Kind, Io} = payload(Msg, true),
    ?assertEqual(iolist_size(Io) - byte_size(Big), SkelBytes),
    [?assertEqual({ok, Msg}, assemble(Kind, Ps)) || N <- [7, 1000, 65536],
                                                    {_, Ps} <- [pieces(Io, N)]],
    %% the binary is a part of the joined bytes, not a copy of its own
    {ok, {_, {_, Got, _}, _}} = assemble(Kind, element(2, pieces(Io, 65536))),
    ?assertEqual(iolist_size(Io), binary:referenced_byte_size(Got)),
    %% a peer without paths, a binary too small, too deep or in too wide a tuple
    ?assertMatch({term, _}, payload(Msg, false)),
    ?assertMatch({term, _}, payload({a, <<"small">>}, true)),
    ?assertMatch({term, _}, payload({{{{Big}}}}, true)),
    ?assertMatch({term, _}, payload(list_to_tuple([Big | lists:seq(1, 16)]), true)),
    ?assertMatch({{path, [1, 1, 1], _}, _}, payload({{{Big}}}, true)),
    %% the largest binary wins
    ?assertMatch({{path, [3], _}, _}, payload({Big, x, <<Big/binary, 0>>}, true)).

path_forged_test() ->
    Big = binary:copy(<<"z">>, 70000),
    {{path, Path, SkelBytes}, Io} = payload({a, Big}, true),
    Bytes = iolist_to_binary(Io),
    ?assertEqual({ok, {a, Big}}, assemble({path, Path, SkelBytes}, [Bytes])),
    [?assertEqual(error, assemble(Kind, [Bytes]))
     || Kind <- [{path, [1], SkelBytes},          % an atom in the binary's place
                 {path, [3], SkelBytes},          % past the tuple
                 {path, [2, 1], SkelBytes},       % a binary is not a tuple
                 {path, Path, SkelBytes - 1},     % the skeleton cut short
                 {path, Path, byte_size(Bytes) + 1}]].

ack_every_test() ->
    Ref = make_ref(),
    {{ack, 0}, [], Rx0} = start(n, #{ref => Ref, sender => self(), to => t, kind => binary,
                                     size => 8, mon => m, data => <<"a">>, ack_every => 3},
                                infinity, new()),
    {Results, _} = lists:mapfoldl(fun(Seq, Rx) -> piece(n, Ref, Seq, <<"b">>, Rx) end,
                                  Rx0, lists:seq(1, 7)),
    ?assertMatch([stored, {ack, 2}, stored, stored, {ack, 5}, stored,
                  {complete, binary, t, _, m}], Results).

%% Turns: B's start waits while A streams, and gets its acknowledgement when A
%% completes; C's, when the streaming B took no piece for a tick (not at the
%% first tick after B's grant); D's, when it waited its patience.
turns_test() ->
    St = fun(R, Size) -> #{ref => R, sender => spawn(fun() -> ok end), to => t,
                           kind => binary, size => Size, mon => R, data => <<"a">>} end,
    [A, B, C, D] = [make_ref() || _ <- lists:seq(1, 4)],
    {{ack, 0}, [], Rx1} = start(n, St(A, 2), infinity, new()),
    {stored, [], Rx2} = start(n, St(B, 3), infinity, Rx1),
    {stored, [], Rx3} = start(n, St(C, 3), infinity, Rx2),
    ?assert(waiting(Rx3)),
    ?assertEqual({[], Rx3}, take_granted(Rx3)),
    %% another node's start does not wait for n's
    {{ack, 0}, [], _} = start(o, St(make_ref(), 3), infinity, Rx3),
    {{complete, binary, t, _, A}, Rx4} = piece(n, A, 1, <<"b">>, Rx3),
    {[B], Rx5} = take_granted(Rx4),
    {[], Rx6} = take_granted(tick(10, Rx5)),       % B was just granted
    {[C], Rx7} = take_granted(tick(10, Rx6)),      % B took no piece since
    ?assertNot(waiting(Rx7)),
    {stored, [], Rx8} = start(n, St(D, 3), infinity, Rx7),
    {{ack, 1}, Rx9} = piece(n, C, 1, <<"b">>, Rx8),
    {[], Rx10} = take_granted(tick(2, Rx9)),       % C took a piece; D waited 1
    {[D], Rx11} = take_granted(tick(2, Rx10)),     % D waited 2: its patience
    ?assertNot(waiting(Rx11)),
    ?assertEqual(3, partials(Rx11)).

%% A partial whose sender no longer monitors the inbox is marked at one sweep
%% and discarded at the next (freeing its reservation and its turn), unless its
%% node still has batches to handle then; pieces that come between (sent
%% before the sender moved on) still count, and a message they complete is
%% delivered.
sweep_test() ->
    [S1, S2, S3] = Senders = [spawn(fun() -> ok end) || _ <- lists:seq(1, 3)],
    St = fun(R, S) -> #{ref => R, sender => S, to => t, kind => binary, size => 3,
                        mon => R, data => <<"a">>} end,
    [A, B, C] = [make_ref() || _ <- Senders],
    {{ack, 0}, [], Rx1} = start(n, St(A, S1), 10, new()),
    {stored, [], Rx2} = start(n, St(B, S2), 10, Rx1),
    {{ack, 0}, [], Rx3} = start(o, St(C, S3), 10, Rx2),
    %% everyone monitors: nothing marked, nothing discarded
    {[], Rx3a} = sweep(Senders, [], Rx3),
    {[], Rx4} = sweep(Senders, [], Rx3a),
    {[], Rx5} = sweep([S3], [], Rx4),              % A and B marked
    {{ack, 1}, Rx6} = piece(n, B, 1, <<"b">>, Rx5),
    {{complete, binary, t, _, C}, Rx7} = piece(o, C, 1, <<"bc">>, Rx6),
    {[], Rx8} = sweep([], [n], Rx7),                % n busy: kept
    ?assertEqual(6, held(n, Rx8)),
    {Mons, Rx9} = sweep([], [], Rx8),
    ?assertEqual(lists:sort([A, B]), lists:sort(Mons)),
    ?assertMatch({[], _}, take_granted(Rx9)),
    ?assertEqual({0, 0}, {held(n, Rx9), partials(Rx9)}),
    ?assertMatch({{error, bad_piece}, _}, piece(n, B, 2, <<"c">>, Rx9)).

assemble_forged_term_test() ->
    ?assertEqual(error, assemble(term, [<<131, 200>>])),
    ?assertEqual({ok, {a, 1}}, assemble(term, [term_to_binary({a, 1})])).
-endif.
