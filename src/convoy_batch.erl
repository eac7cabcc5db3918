%% @private
%% The queues of an outbound lane, pure: one FIFO queue per destination node, and
%% which of them may ship now. Part of the lane's core (`convoy_lane_core', which
%% the lane process carries out): this module never sends anything.
%%
%% A queue holds entries in the order the lane received them:
%% <ul>
%% <li>`{To, Msg}' and `{[To], Msg}' count as messages (one per entry);</li>
%% <li>`{'$convoy_large', To, Msg}' is a message that never shares a batch with
%%   small ones: a large message is never held behind others in a batch, nor
%%   others behind it. Large messages in a row leave in one chunk (up to
%%   `LARGE_RUN'): a stream of them costs the lane one round per run, not one per
%%   message, and its messages of up to `SHARE_BYTES' share distribution
%%   messages of up to `RUN_BYTES' (`run_groups/1');</li>
%% <li>`{'$convoy_mark', Id, Node}' stays in the lane: it is answered once
%%   everything before it has left the node (`convoy:flush/0,1', see
%%   `convoy_lane_core').</li>
%% </ul>
%% A node's queue is `ready' (can ship), `busy' (a stopping lane found its
%% connection busy and does not wait) or `connecting'. Only ready queues ship,
%% and a chunk always comes from the head, so entries leave in the order they came.
-module(convoy_batch).

-export([new/0, push/4, push_many/5, push_many/6, take/3, requeue/3, drop/2, forget/2, status/2, set_status/3,
         due/4, next_timeout/3, buffered/1, buffered/2, nodes/1, is_message/1,
         count_messages/1, run_groups/1, run_groups/2]).

-export_type([core/0, status/0, reason/0]).

-include("convoy_tags.hrl").

%% Large messages in one chunk at most: enough to spread a chunk's cost (the
%% lane's round) over messages that each take tens of microseconds on the wire,
%% few enough that a lane waiting out a busy connection with a run gives room
%% back to blocked senders often.
-define(LARGE_RUN, 16).
%% Large messages of a run of at most SHARE_BYTES each share one distribution
%% message while their encoded sizes add up to at most RUN_BYTES: a stream of
%% 64 KiB messages then costs one send per 7 of them rather than one each. Groups
%% stay under the allocators' 512 KiB single-block threshold, and larger messages
%% go alone (doc/decisions.md, "Large messages share distribution messages").
-define(RUN_BYTES, 491520).
-define(SHARE_BYTES, 131072).

%% A node's queue holds its entries in segments, each a list of entries as it was
%% pushed: a push and the take of all that was pushed since (a flood's usual
%% round) copy nothing.
-record(nq, {status = ready :: status(),
             q = queue:new() :: queue:queue([term(), ...]),
             msgs = 0 :: non_neg_integer(),
             large = 0 :: non_neg_integer(),
             %% when the oldest queued message was pushed (or earlier): read
             %% only while msgs > 0, set by the push that makes msgs > 0
             since = 0 :: integer()}).

-opaque core() :: #{node() => #nq{}}.
-type status() :: ready | busy | connecting.
-type reason() :: drained | max_batch | max_delay.

-spec new() -> core().
new() -> #{}.

%% @doc Append an entry to `Node''s queue; `Now' is a monotonic time in microseconds.
-spec push(node(), term(), integer(), core()) -> core().
push(Node, Entry, Now, Core) ->
    push_many(Node, [Entry], count(Entry), Now, Core).

%% @doc Append entries, in order, `K' of them messages.
-spec push_many(node(), [term()], non_neg_integer(), integer(), core()) -> core().
push_many(Node, Entries, K, Now, Core) ->
    push_many(Node, Entries, K, count_large(Entries), Now, Core).

%% @doc `push_many/5' when the caller has counted the large messages among the
%% entries (`Large').
-spec push_many(node(), [term()], non_neg_integer(), non_neg_integer(), integer(), core()) ->
          core().
push_many(Node, Entries, K, Large, Now, Core) ->
    NQ = case Core of
             #{Node := Q} -> Q;
             _ -> #nq{}
         end,
    %% Only a message starts the wait: a flush mark pushed to a queue with no
    %% messages must not reset it, or messages put back after it (`requeue/3')
    %% would look newer than they are (never due with a negative clock).
    Since = case NQ#nq.msgs of
                0 when K > 0 -> Now;
                _ -> NQ#nq.since
            end,
    Core#{Node => NQ#nq{q = append(Entries, NQ#nq.q),
                        msgs = NQ#nq.msgs + K, large = NQ#nq.large + Large,
                        since = Since}}.

append([], Q) -> Q;
append(Entries, Q) -> queue:in(Entries, Q).

%% @doc Take the next chunk of `Node''s queue: at most `Max' messages, with the
%% control entries among them, from the head; large messages make chunks of their
%% own (up to `LARGE_RUN' in a row). The queue must be ready; a node without a
%% queue gives nothing.
-spec take(node(), pos_integer(), core()) -> {[term()], core()}.
take(Node, Max, Core) ->
    case Core of
        #{Node := #nq{status = ready} = NQ} ->
            {Chunk, NQ1} = take_chunk(Max, NQ),
            {Chunk, Core#{Node := NQ1}};
        #{Node := _} ->
            erlang:error(badarg, [Node, Max, Core]);
        _ ->
            {[], Core}
    end.

take_chunk(Max, NQ = #nq{q = Q, msgs = Msgs, large = 0}) when Msgs =< Max ->
    {entries(Q), NQ#nq{q = queue:new(), msgs = 0}};
take_chunk(Max, NQ = #nq{q = Q, msgs = Msgs, large = 0}) ->
    {Chunk, Rest} = split(Max, Q, []),
    {Chunk, NQ#nq{q = Rest, msgs = Msgs - Max}};
take_chunk(Max, NQ = #nq{q = Q, msgs = Msgs, large = Large}) ->
    {Chunk, Rest} = split_large(Max, Q, [], none),
    {Chunk, NQ#nq{q = Rest, msgs = Msgs - count_messages(Chunk),
                  large = Large - count_large(Chunk)}}.

%% Like split/3, but large messages and the others never share a chunk: a chunk
%% is a run of small messages or a run of large ones (the lane ships each large
%% message alone, a run of them in one go). Kind: what the chunk holds so far
%% (none, small or large).
split_large(0, Q, Acc, _Kind) ->
    {lists:reverse(Acc), Q};
split_large(N, Q, Acc, Kind) ->
    case out(Q) of
        {empty, Q} ->
            {lists:reverse(Acc), Q};
        {{value, {?TAG_LARGE, _, _} = E}, Q1} when Kind =/= small ->
            split_large(min(N, ?LARGE_RUN) - 1, Q1, [E | Acc], large);
        {{value, {?TAG_LARGE, _, _}}, _Q1} ->
            {lists:reverse(Acc), Q};
        {{value, E}, Q1} ->
            case is_message(E) of
                false -> split_large(N, Q1, [E | Acc], Kind);
                true when Kind =:= large -> {lists:reverse(Acc), Q};
                true -> split_large(N - 1, Q1, [E | Acc], small)
            end
    end.

%% @doc A run of large messages (a chunk from `take/3') in groups that each leave in
%% one distribution message, in order: consecutive messages of at most
%% `SHARE_BYTES' each (encoded) while they add up to at most `RUN_BYTES'; a larger
%% message is a group of its own. Other entries (marks) join the group they fall
%% in.
-spec run_groups([term()]) -> [[term(), ...]].
run_groups(Run) -> run_groups(Run, {?RUN_BYTES, ?SHARE_BYTES}).

%% @doc `run_groups/1' with groups of at most `GroupBytes', of messages of at most
%% `ShareBytes'.
-spec run_groups([term()], {GroupBytes :: non_neg_integer(), ShareBytes :: non_neg_integer()}) ->
          [[term(), ...]].
run_groups(Run, Limits) -> run_groups(Run, Limits, 0, [], []).

run_groups([], _Limits, _Bytes, [], Groups) ->
    lists:reverse(Groups);
run_groups([], _Limits, _Bytes, Group, Groups) ->
    lists:reverse(Groups, [lists:reverse(Group)]);
run_groups([{?TAG_LARGE, _, Msg} = E | Rest], Limits = {GroupBytes, ShareBytes}, Bytes,
           Group, Groups) ->
    B = convoy_size:bytes(Msg),
    if
        B > ShareBytes ->
            %% Alone: counted as over GroupBytes, so the next message starts anew.
            run_groups(Rest, Limits, GroupBytes + 1, [E], close(Group, Groups));
        Bytes + B > GroupBytes ->
            run_groups(Rest, Limits, B, [E], close(Group, Groups));
        true ->
            run_groups(Rest, Limits, Bytes + B, [E | Group], Groups)
    end;
run_groups([E | Rest], Limits, Bytes, Group, Groups) ->
    run_groups(Rest, Limits, Bytes, [E | Group], Groups).

%% A group of its own, never an empty one.
close([], Groups) -> Groups;
close(Group, Groups) -> [lists:reverse(Group) | Groups].

count_large(Entries) -> count_large(Entries, 0).

count_large([{?TAG_LARGE, _, _} | Rest], N) -> count_large(Rest, N + 1);
count_large([_ | Rest], N) -> count_large(Rest, N);
count_large([], N) -> N.

%% The first N messages (with the marks among them), walking the segments.
split(0, Q, Acc) ->
    {lists:reverse(Acc), Q};
split(N, Q, Acc) ->
    {{value, Segment}, Q1} = queue:out(Q),
    split_segment(N, Segment, Q1, Acc).

split_segment(0, [_ | _] = Segment, Q, Acc) ->
    {lists:reverse(Acc), queue:in_r(Segment, Q)};
split_segment(N, [], Q, Acc) ->
    split(N, Q, Acc);
split_segment(N, [E | Segment], Q, Acc) ->
    split_segment(N - count(E), Segment, Q, [E | Acc]).

%% The next entry, as queue:out/1 would answer for a queue of entries.
out(Q) ->
    case queue:out(Q) of
        {{value, [E]}, Q1} -> {{value, E}, Q1};
        {{value, [E | Segment]}, Q1} -> {{value, E}, queue:in_r(Segment, Q1)};
        {empty, _} = Empty -> Empty
    end.

%% Every entry, in order (a single segment as it was pushed).
entries(Q) ->
    lists:append(queue:to_list(Q)).

%% @doc Put a chunk that could not leave back at the head of its queue. The
%% queue's wait keeps the time the chunk's oldest message (or an older one) was
%% pushed (the lane pushes no message between a take and its requeue), so the
%% chunk is due as soon as the queue is ready again.
-spec requeue(node(), [term()], core()) -> core().
requeue(Node, Chunk, Core) ->
    NQ = maps:get(Node, Core, #nq{}),
    Q = case Chunk of
            [] -> NQ#nq.q;
            _ -> queue:in_r(Chunk, NQ#nq.q)
        end,
    Core#{Node => NQ#nq{q = Q, msgs = NQ#nq.msgs + count_messages(Chunk),
                        large = NQ#nq.large + count_large(Chunk)}}.

%% @doc Empty `Node''s queue (the node cannot be reached); returns what was in it.
-spec drop(node(), core()) -> {[term()], core()}.
drop(Node, Core) ->
    case Core of
        #{Node := NQ} ->
            {entries(NQ#nq.q), Core#{Node := NQ#nq{q = queue:new(), msgs = 0, large = 0}}};
        _ ->
            {[], Core}
    end.

%% @doc Forget `Node' if its queue is empty and ready (`busy' otherwise): nothing
%% is lost (a later push starts it afresh), and queues of nodes no longer sent to
%% do not pile up.
-spec forget(node(), core()) -> {ok, core()} | busy.
forget(Node, Core) ->
    case Core of
        #{Node := #nq{status = ready, msgs = 0, q = Q}} ->
            case queue:is_empty(Q) of
                true -> {ok, maps:remove(Node, Core)};
                false -> busy
            end;
        #{Node := _} ->
            busy;
        _ ->
            {ok, Core}
    end.

-spec status(node(), core()) -> status().
status(Node, Core) ->
    case Core of
        #{Node := #nq{status = S}} -> S;
        _ -> ready
    end.

-spec set_status(node(), status(), core()) -> core().
set_status(Node, Status, Core) ->
    NQ = maps:get(Node, Core, #nq{}),
    Core#{Node => NQ#nq{status = Status}}.

%% @doc Ready, non-empty queues that should ship now, with the reason.
%% With `MaxDelay' 0 every such queue ships as soon as the lane's mailbox is drained;
%% otherwise a queue waits until its oldest message is `MaxDelay' microseconds old
%% or it holds `MaxBatch' messages. A queue holding only control entries ships at once.
-spec due(integer(), pos_integer(), non_neg_integer(), core()) -> [{node(), reason()}].
due(Now, MaxBatch, MaxDelay, Core) ->
    maps:fold(
      fun(Node, #nq{status = ready, q = Q, msgs = Msgs, since = Since}, Acc) ->
              case queue:is_empty(Q) of
                  true -> Acc;
                  false when Msgs >= MaxBatch -> [{Node, max_batch} | Acc];
                  false when MaxDelay =:= 0 -> [{Node, drained} | Acc];
                  false when Msgs =:= 0 -> [{Node, drained} | Acc];
                  false when Now - Since >= MaxDelay -> [{Node, max_delay} | Acc];
                  false -> Acc
              end;
         (_Node, _NQ, Acc) ->
              Acc
      end, [], Core).

%% @doc Milliseconds until the oldest waiting ready queue is due (`infinity' if none).
%% Never more than `MaxDelay': whatever a queue's time says, the lane's receive
%% timeout stays in range (a wait computed from a wrong time once crashed it).
-spec next_timeout(integer(), non_neg_integer(), core()) -> timeout().
next_timeout(_Now, 0, _Core) ->
    infinity;
next_timeout(Now, MaxDelay, Core) ->
    maps:fold(
      fun(_Node, #nq{status = ready, msgs = Msgs, since = Since}, Acc) when Msgs > 0 ->
              Left = max(0, min(MaxDelay, Since + MaxDelay - Now)),
              min(Acc, (Left + 999) div 1000);
         (_Node, _NQ, Acc) ->
              Acc
      end, infinity, Core).

%% @doc Messages waiting in all queues.
-spec buffered(core()) -> non_neg_integer().
buffered(Core) ->
    maps:fold(fun(_, #nq{msgs = M}, Acc) -> Acc + M end, 0, Core).

-spec buffered(node(), core()) -> non_neg_integer().
buffered(Node, Core) ->
    case Core of
        #{Node := #nq{msgs = M}} -> M;
        _ -> 0
    end.

-spec nodes(core()) -> [node()].
nodes(Core) -> maps:keys(Core).

-spec is_message(term()) -> boolean().
is_message({?TAG_MARK, _, _}) -> false;
is_message(_) -> true.

-spec count_messages([term()]) -> non_neg_integer().
count_messages(Entries) -> lists:foldl(fun(E, N) -> N + count(E) end, 0, Entries).

count(E) ->
    case is_message(E) of
        true -> 1;
        false -> 0
    end.

-ifdef(TEST).
-include_lib("eunit/include/eunit.hrl").

order_and_limit_test() ->
    C0 = lists:foldl(fun(I, C) -> push(n, {p, I}, 0, C) end, new(), lists:seq(1, 5)),
    ?assertEqual(5, buffered(C0)),
    {A, C1} = take(n, 2, C0),
    ?assertEqual([{p, 1}, {p, 2}], A),
    {B, C2} = take(n, 10, C1),
    ?assertEqual([{p, 3}, {p, 4}, {p, 5}], B),
    ?assertEqual(0, buffered(C2)).

control_entries_ride_along_test() ->
    C0 = push(n, {p, 1}, 0, push(n, {?TAG_MARK, self(), t}, 0, new())),
    ?assertEqual(1, buffered(C0)),
    ?assertEqual([{n, drained}], due(0, 10, 0, C0)),
    {Chunk, _} = take(n, 1, C0),
    ?assertEqual([{?TAG_MARK, self(), t}, {p, 1}], Chunk).

busy_queue_not_due_test() ->
    C0 = set_status(n, busy, push(n, {p, 1}, 0, new())),
    ?assertEqual([], due(0, 10, 0, C0)).

max_delay_test() ->
    C0 = push(n, {p, 1}, 1000, new()),
    ?assertEqual([], due(1500, 10, 1000, C0)),
    ?assertEqual(1, next_timeout(1500, 1000, C0)),
    ?assertEqual([{n, max_delay}], due(2000, 10, 1000, C0)),
    ?assertEqual([{n, max_batch}], due(1500, 1, 1000, C0)).

large_ships_alone_test() ->
    L = {?TAG_LARGE, p, big},
    C0 = lists:foldl(fun(E, C) -> push(n, E, 0, C) end, new(),
                     [{p, 1}, {p, 2}, L, {p, 3}, L, {?TAG_MARK, 1, n}, L, {p, 4}]),
    {A, C1} = take(n, 10, C0),
    ?assertEqual([{p, 1}, {p, 2}], A),
    {B, C2} = take(n, 10, C1),
    ?assertEqual([L], B),
    {D, C3} = take(n, 10, C2),
    ?assertEqual([{p, 3}], D),
    %% Large messages in a row (a mark between them) leave together.
    {E, C4} = take(n, 10, C3),
    ?assertEqual([L, {?TAG_MARK, 1, n}, L], E),
    ?assertEqual(1, buffered(n, C4)),
    {F, C5} = take(n, 10, requeue(n, E, C4)),
    ?assertEqual(E, F),
    ?assertEqual(1, buffered(n, C5)),
    {G, _} = take(n, 10, C5),
    ?assertEqual([{p, 4}], G).

large_runs_are_bounded_test() ->
    L = {?TAG_LARGE, p, big},
    C0 = lists:foldl(fun(E, C) -> push(n, E, 0, C) end, new(), lists:duplicate(40, L)),
    {A, C1} = take(n, 1000, C0),
    ?assertEqual(?LARGE_RUN, length(A)),
    {B, C2} = take(n, 5, C1),
    ?assertEqual(5, length(B)),
    ?assertEqual(40 - ?LARGE_RUN - 5, buffered(n, C2)).

run_groups_test() ->
    L = fun(N) -> {?TAG_LARGE, p, binary:copy(<<0>>, N)} end,
    Mark = {?TAG_MARK, 1, n},
    Size = convoy_size:bytes(binary:copy(<<0>>, 100)),
    Two = {2 * Size, 1000},
    ?assertEqual([], run_groups([], Two)),
    %% Within the bound together: one group; past it: a new group, in order.
    ?assertEqual([[L(100), L(100)], [L(100)]], run_groups([L(100), L(100), L(100)], Two)),
    %% A message larger than ShareBytes alone, never an empty group.
    ?assertEqual([[L(5000)], [L(100)]], run_groups([L(5000), L(100)], Two)),
    ?assertEqual([[L(100)], [L(5000)], [L(100), L(100)]],
                 run_groups([L(100), L(5000), L(100), L(100)], Two)),
    ?assertEqual([[L(5000)], [L(5000)]], run_groups([L(5000), L(5000)], {100000, 1000})),
    %% Marks stay where they were.
    ?assertEqual([[L(100), Mark, L(100)]], run_groups([L(100), Mark, L(100)], Two)),
    %% The defaults: a run of 64 KiB messages leaves in groups of 7, a run of
    %% 256 KiB ones one by one.
    Run = lists:duplicate(?LARGE_RUN, L(65536)),
    ?assertEqual([7, 7, 2], [length(G) || G <- run_groups(Run)]),
    ?assertEqual(Run, lists:append(run_groups(Run))),
    Big = lists:duplicate(3, L(262144)),
    ?assertEqual([[E] || E <- Big], run_groups(Big)).

%% A flush mark pushed after a take does not restart the wait: the chunk put back
%% is as old as when it was pushed (the clock is negative here, as it can be).
requeue_after_mark_keeps_age_test() ->
    T0 = -576460752303423488,
    C0 = push(n, {p, 1}, T0, new()),
    {Chunk, C1} = take(n, 10, C0),
    C2 = push(n, {?TAG_MARK, 1, n}, T0 + 5, C1),
    C3 = requeue(n, Chunk, C2),
    ?assertEqual([{n, max_delay}], due(T0 + 1000, 10, 1000, C3)),
    ?assertEqual(0, next_timeout(T0 + 1000, 1000, C3)).

%% A queue's time after the lane's clock (it cannot be, but a wrong time once
%% made a receive timeout out of range): the wait is at most max_delay.
wait_at_most_max_delay_test() ->
    T0 = -576460752303423488,
    C0 = push(n, {p, 1}, T0 + (1 bsl 50), new()),
    ?assertEqual(1, next_timeout(T0, 1000, C0)),
    ?assertEqual(10000, next_timeout(T0, 10000000, C0)).

requeue_test() ->
    C0 = push(n, {p, 3}, 0, new()),
    C1 = requeue(n, [{p, 1}, {p, 2}], C0),
    {All, _} = take(n, 10, C1),
    ?assertEqual([{p, 1}, {p, 2}, {p, 3}], All).
-endif.
