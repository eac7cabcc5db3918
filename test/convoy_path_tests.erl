%% convoy_path: every combination of facts, checked against the ordering rules
%% (convoy_route's header) rather than against a copy of the table.
-module(convoy_path_tests).

-include_lib("eunit/include/eunit.hrl").

-define(SIZES, [small, large]).
-define(CALMS, [busy, unpaid, quiet, settled]).
-define(ROUTES, [convoy, unanswered, plain, none]).

calm_test() ->
    ?assertEqual(busy, convoy_path:calm(10, 20)),
    ?assertEqual(busy, convoy_path:calm(20, 20)),
    ?assertEqual(quiet, convoy_path:calm(21, 20)),
    ?assertEqual(quiet, convoy_path:calm(1000, 20)),
    ?assertEqual(settled, convoy_path:calm(1001, 20)),
    %% a window longer than the settling time: settled once past the window
    ?assertEqual(busy, convoy_path:calm(4000, 5000)),
    ?assertEqual(settled, convoy_path:calm(5001, 5000)),
    ?assertEqual(busy, convoy_path:calm(1 bsl 40, never)),
    %% the clock is monotonic but a gap read across lanes may be negative
    ?assertEqual(busy, convoy_path:calm(-5, 0)).

%% Rule 3: a marked sender never sends directly before an admission. An unmarked
%% one bypasses the lane only with a large message or on a calm lane.
unadmitted_test() ->
    [begin
         P = convoy_path:unadmitted(Size, Calm, Marked),
         ?assert(lists:member(P, [direct, admit])),
         Marked andalso ?assertEqual(admit, P),
         (not Marked) andalso Size =:= small andalso Calm =:= busy
             andalso ?assertEqual(admit, P),
         (not Marked) andalso (Size =:= large orelse Calm =/= busy)
             andalso ?assertEqual(direct, P)
     end || Size <- ?SIZES, Calm <- ?CALMS, Marked <- [true, false]].

%% Rule 2: a small message bypasses only a calm lane (a flood is batched); any
%% other message may bypass an idle one (convoy_route reads idleness after this).
may_bypass_test() ->
    [begin
         B = convoy_path:may_bypass(Size, Calm),
         Size =:= small andalso Calm =:= busy andalso ?assertNot(B),
         (Size =:= large orelse Calm =/= busy) andalso ?assert(B)
     end || Size <- ?SIZES, Calm <- ?CALMS].

%% Once it may bypass: a direct send to a convoy peer only after a barrier (its
%% inbox may hold the sender's earlier messages); a node convoy has not dealt
%% with goes to the lane, and so does one that has not answered a wait since one
%% ran out (no sender waits on it again); a plain peer has no inbox to wait for.
bypass_test() ->
    [begin
         P = convoy_path:bypass(Size, Calm, Route),
         case Route of
             none -> ?assertEqual(lane, P);
             unanswered -> ?assertEqual(lane, P);
             plain -> ?assertEqual(direct, P);
             convoy -> ?assertNotEqual(direct, P)
         end,
         %% a large message never rides through an inbox as a batch of one
         Size =:= large andalso ?assertNotEqual(inbox, P),
         Size =:= large andalso Route =:= convoy andalso ?assertEqual(barrier_direct, P),
         %% a small message never waits for a barrier: one rides behind it, only
         %% when the lane has been calm for a while ...
         Size =:= small andalso ?assertNotEqual(barrier_direct, P),
         Size =:= small andalso Route =:= convoy andalso Calm =:= quiet
             andalso ?assertEqual(inbox, P),
         %% ... or when batching does not pay: back to what plain `!' costs
         Size =:= small andalso Route =:= convoy andalso Calm =/= quiet
             andalso ?assertEqual(inbox_barrier, P)
     end || Size <- ?SIZES, Calm <- [unpaid, quiet, settled], Route <- ?ROUTES].

%% On a busy lane a sender that streams (its own sends within the window) keeps
%% the lane; another keeps it, among at least 8 senders taking turns, when its
%% batches pay (one and an eighth messages or more per distribution send, in
%% sixteenths) or 10 ms after a judgement that they did not.
streams_test() ->
    ?assert(convoy_path:streams(20, 20)),
    ?assert(convoy_path:streams(-3, 20)),
    ?assertNot(convoy_path:streams(21, 20)),
    ?assert(convoy_path:streams(1 bsl 40, never)).

pays_test() ->
    Many = {256, 8 * 256}, % gaps in 256ths of a microsecond: 8 senders take turns
    Few = {256, 8 * 256 - 1},
    ?assertEqual(busy, pays_after(18, 0, Many)),
    ?assertEqual(busy, pays_after(16000, 9999, Many)),
    ?assertEqual(unpaid, pays_after(17, 0, Many)),
    ?assertEqual(unpaid, pays_after(16, 10000, Many)),
    %% an expired verdict: the lane is tried again ...
    ?assertEqual(busy, pays_after(16, 10001, Many)),
    ?assertEqual(busy, pays_after(0, 1 bsl 40, {0, 0})),
    %% ... but neither then nor when batches pay by fewer senders
    ?assertEqual(unpaid, pays_after(16, 10001, Few)),
    ?assertEqual(unpaid, pays_after(18, 0, Few)),
    ?assertEqual(unpaid, pays_after(0, 1 bsl 40, {1000 * 16, 7999 * 16})),
    ?assertEqual(paid, convoy_path:unpaid_until(18, -5)),
    ?assertEqual(9995, convoy_path:unpaid_until(17, -5)).

%% The lane's verdict after batches of BatchX16, shipped at a negative time (the
%% clock can be negative), as a sender reads it Since microseconds later, with
%% the recent gaps between the lane's small sends and since their senders' own.
pays_after(BatchX16, Since, Gaps) ->
    ShippedAt = -123456789,
    convoy_path:pays(convoy_path:unpaid_until(BatchX16, ShippedAt), ShippedAt + Since, Gaps).

%% A quiet lane is kept while batches pay, by enough senders.
quiet_test() ->
    ?assertEqual(busy, convoy_path:quiet(paid, {16, 128})),
    ?assertEqual(quiet, convoy_path:quiet(paid, {16, 127})),
    ?assertEqual(quiet, convoy_path:quiet(-5, {16, 128})),
    ?assertEqual(quiet, convoy_path:quiet(convoy_path:long_ago(-5), {0, 0})).

%% Pieces from chunk_threshold on, only with small traffic to protect (a small
%% message within chunk_guard ms), or always; never with the threshold at infinity.
pieces_test() ->
    MiB = 1048576,
    ?assertNot(convoy_path:pieces(10 * MiB, infinity, {always, 0})),
    ?assertNot(convoy_path:pieces(MiB, 4 * MiB, {always, 0})),
    ?assert(convoy_path:pieces(4 * MiB, 4 * MiB, {always, 1 bsl 50})),
    ?assert(convoy_path:pieces(10 * MiB, 4 * MiB, {1000, 999999})),
    ?assert(convoy_path:pieces(10 * MiB, 4 * MiB, {1000, 1000000})),
    ?assertNot(convoy_path:pieces(10 * MiB, 4 * MiB, {1000, 1000001})),
    ?assertNot(convoy_path:pieces(10 * MiB, 4 * MiB, {0, 1})),
    %% the lane's "long ago" for no small send yet: bulk alone goes whole
    ?assertNot(convoy_path:pieces(10 * MiB, 4 * MiB, {1000, 1 bsl 40})).

%% The sender's own part. An unmarked sender that found a calm lane reuses it
%% for CALM_REUSE (3) sends; its next record stands for them (its gap per send).
reuse_test() ->
    #{'CALM_REUSE' := Reuse} = convoy_path:constants(),
    Own0 = convoy_path:own(),
    ?assertEqual(record, convoy_path:reuse(Own0)),
    {Gap0, 1, Own1} = convoy_path:unmarked_record(Own0, b@h, 1000),
    ?assert(Gap0 > 1000000), % the first send counts as long after
    Own2 = convoy_path:found(Own1, quiet),
    Own3 = lists:foldl(fun(_, O) -> {quiet, O1} = convoy_path:reuse(O), O1 end, Own2,
                       lists:seq(1, Reuse)),
    ?assertEqual(record, convoy_path:reuse(Own3)),
    ?assertMatch({100, 4, _}, convoy_path:unmarked_record(Own3, b@h, 1400)),
    %% a busy lane is not reused
    ?assertEqual(record, convoy_path:reuse(convoy_path:found(Own1, busy))).

%% Streaming is judged per node: sends to two nodes a microsecond apart, a round
%% every 100 us, stream to neither.
per_node_test() ->
    Rounds = lists:foldl(
               fun(T, O) ->
                       {_, _, O1} = convoy_path:unmarked_record(O, b@h, T),
                       {GapC, 1, O2} = convoy_path:unmarked_record(O1, c@h, T + 1),
                       T > 0 andalso ?assertEqual(100, GapC),
                       ?assertNot(T > 0 andalso convoy_path:streams(GapC, 20)),
                       O2
               end, convoy_path:own(), [0, 100, 200]),
    ?assertEqual(200, convoy_path:own_last(Rounds, b@h)),
    ?assertEqual(201, convoy_path:own_last(Rounds, c@h)),
    ?assertEqual(none, convoy_path:own_last(Rounds, d@h)).

%% A marked sender that streams skips at most SKIP_MAX (15) records in a row;
%% the record after them counts its gap per send over them, and, finding it still
%% streaming, starts the next count at once (no clock read to start it).
marked_skip_test() ->
    #{'SKIP_MAX' := Max} = convoy_path:constants(),
    {record, _, 1, Own0, undefined} =
        convoy_path:marked_record(convoy_path:own(), 0, b@h, 0, 20),
    ?assertEqual(record, convoy_path:skip(undefined)), % not counting skips yet
    {skip, 1} = convoy_path:marked_record(Own0, 0, b@h, 5, 20),
    Skipped = lists:foldl(fun(_, S) -> {skip, S1} = convoy_path:skip(S), S1 end, 1,
                          lists:seq(2, Max)),
    ?assertEqual(Max, Skipped),
    ?assertEqual(record, convoy_path:skip(Skipped)),
    {record, 1, 16, Own1, 0} = convoy_path:marked_record(Own0, Skipped, b@h, 16, 20),
    ?assertEqual(16, convoy_path:own_last(Own1, b@h)),
    ?assertEqual({skip, 1}, convoy_path:skip(0)),
    %% a sender that does not stream records, and counts no skips
    ?assertMatch({record, 100, 1, _, undefined},
                 convoy_path:marked_record(Own0, 0, b@h, 100, 20)),
    %% after SKIP_MAX skips over a pause: a record, no count
    ?assertMatch({record, 100, 16, _, undefined},
                 convoy_path:marked_record(Own1, Skipped, b@h, 16 + 1600, 20)).

%% Held behind its node's messages, a streaming sender records only the lane's
%% every SKIP_MAX + 1th admission, the record standing for SKIP_MAX + 1 sends,
%% and skips the others whatever its count; a sender that does not stream
%% records as on an idle lane (`skip/1': its first record then counts).
held_record_test() ->
    #{'SKIP_MAX' := Max} = convoy_path:constants(),
    Period = Max + 1,
    Records = [V || V <- lists:seq(-3 * Period, 5 * Period), % any integer
                    convoy_path:held_record(0, V) =/= skip],
    ?assertEqual(9, length(Records)),
    [?assertEqual(0, V rem Period) || V <- Records],
    [?assertEqual({record, Max}, convoy_path:held_record(S, 2 * Period)) || S <- [0, 3, Max]],
    [?assertEqual(skip, convoy_path:held_record(S, 2 * Period + 1)) || S <- [0, 3, Max]],
    [?assertEqual({record, undefined}, convoy_path:held_record(undefined, V))
     || V <- [1, Period, 7]],
    %% after such a record, the sender counts from the lane's admission it took
    ?assertEqual(skip, convoy_path:held_record({since, Period}, 2 * Period + 1)),
    ?assertEqual({record, Max}, convoy_path:held_record({since, Period}, 2 * Period)),
    %% its skips, counted by the lane's admissions since (at most SKIP_MAX)
    ?assertEqual(4, convoy_path:counted({since, -10}, -5)), % the count may be any integer
    ?assertEqual(0, convoy_path:counted({since, 10}, 11)),
    ?assertEqual(Max, convoy_path:counted({since, 10}, 10 + 100)),
    ?assertEqual(0, convoy_path:counted({since, 10}, none)),
    [?assertEqual(S, convoy_path:counted(S, 99)) || S <- [undefined, 0, 3]],
    %% the record stands for Period sends: its gap per send, never a skip
    {record, _, 1, Own0, _} = convoy_path:marked_record(convoy_path:own(), 0, b@h, 0, 20),
    ?assertMatch({record, 2, Period, _, 0},
                 convoy_path:marked_record(Own0, Max, b@h, 2 * Period, 20)).

%% A multicast entry records one send and leaves the reuse as it is.
entry_record_test() ->
    {_, _, Own0} = convoy_path:unmarked_record(convoy_path:own(), b@h, 0),
    Own1 = convoy_path:found(Own0, settled),
    {50, Own2} = convoy_path:entry_record(Own1, b@h, 50),
    ?assertMatch({settled, _}, convoy_path:reuse(Own2)),
    ?assertEqual(50, convoy_path:own_last(Own2, b@h)).

%% A large message's node holds at most one connection buffer (a message alone
%% may pass it, convoy_held); a small one's the node's bound; large_threshold
%% `infinity' makes no message large.
held_bytes_test() ->
    Conn = 1048576,
    ?assertEqual(Conn, convoy_path:held_bytes(65536, 65536, 64 * Conn, Conn)),
    ?assertEqual(Conn, convoy_path:held_bytes(65536, 65536, infinity, Conn)),
    ?assertEqual(4096, convoy_path:held_bytes(65536, 65536, 4096, Conn)),
    ?assertEqual(64 * Conn, convoy_path:held_bytes(65535, 65536, 64 * Conn, Conn)),
    ?assertEqual(infinity, convoy_path:held_bytes(65535, 65536, infinity, Conn)),
    ?assertEqual(64 * Conn, convoy_path:held_bytes(1 bsl 30, infinity, 64 * Conn, Conn)).
