%% convoy_held: room within the bounds, release, and the forgetting protocol; the
%% reassembly bound's shares.
-module(convoy_held_tests).

-include_lib("eunit/include/eunit.hrl").
-include("convoy_runtime.hrl").

bounds_test() ->
    H = convoy_held:new(),
    ?assertEqual(ok, convoy_held:hold(H, 10, 2, infinity)),
    ?assertEqual(ok, convoy_held:hold(H, 10, 2, infinity)),
    ?assertEqual(full, convoy_held:hold(H, 10, 2, infinity)),
    ?assertEqual({2, 20}, convoy_held:read(H)),
    ?assertNot(convoy_held:has_room(H, 1, 2, infinity)),
    ok = convoy_held:release(H, 1, 10),
    ?assert(convoy_held:has_room(H, 1, 2, infinity)),
    ok = convoy_held:release(H, 1, 10),
    ?assert(convoy_held:is_empty(H)).

%% hold_behind/4 takes room only behind messages already held: nothing taken
%% while the row holds none; the bounds and a closed row answer as hold/4's.
hold_behind_test() ->
    H = convoy_held:new(),
    ?assertEqual(empty, convoy_held:hold_behind(H, 10, 2, infinity)),
    ?assertEqual({0, 0}, convoy_held:read(H)),
    ok = convoy_held:hold(H, 10, 2, infinity),
    ?assertEqual(ok, convoy_held:hold_behind(H, 7, 2, infinity)),
    ?assertEqual({2, 17}, convoy_held:read(H)),
    ?assertEqual(full, convoy_held:hold_behind(H, 7, 2, infinity)),
    ?assertEqual({2, 17}, convoy_held:read(H)),
    ok = convoy_held:release(H, 2, 17),
    ?assertEqual(empty, convoy_held:hold_behind(H, 7, 2, infinity)),
    ?assert(convoy_held:try_close(H)),
    ?assertEqual(closed, convoy_held:hold_behind(H, 7, 2, infinity)),
    ?assertEqual({0, 0}, convoy_held:read(H)).

%% A message alone may exceed the byte bound; a second one may not.
byte_bound_test() ->
    H = convoy_held:new(),
    ?assertEqual(ok, convoy_held:hold(H, 500, infinity, 100)),
    ?assertEqual(full, convoy_held:hold(H, 1, infinity, 100)),
    ?assertEqual({1, 500}, convoy_held:read(H)).

%% hold/3 and has_room/3 take the bounds of the settings in force: under `block'
%% a large message is held within one distribution connection buffer
%% (dist_buf_busy_limit), a small one within max_buffered_bytes; under `drop' and
%% `error' both within max_buffered_bytes.
settings_bound_test() ->
    Conn = erlang:system_info(dist_buf_busy_limit),
    RT = #runtime{max_buffered = infinity, max_buffered_bytes = 64 * Conn,
                  large_threshold = 65536, overload = block},
    H = convoy_held:new(),
    Large = 65536,
    Fit = Conn div Large,
    [?assertEqual(ok, convoy_held:hold(H, Large, RT)) || _ <- lists:seq(1, Fit)],
    ?assertEqual(full, convoy_held:hold(H, Large, RT)),
    ?assertNot(convoy_held:has_room(H, Large, RT)),
    ?assert(convoy_held:has_room(H, 100, RT)),
    ?assertEqual(ok, convoy_held:hold(H, 100, RT)),
    ok = convoy_held:release(H, Fit + 1, Fit * Large + 100),
    %% without a large threshold every message is small
    NoLarge = RT#runtime{large_threshold = infinity},
    [?assertEqual(ok, convoy_held:hold(H, Large, NoLarge)) || _ <- lists:seq(1, Fit + 1)],
    ?assertEqual({Fit + 1, (Fit + 1) * Large}, convoy_held:read(H)),
    ok = convoy_held:release(H, Fit + 1, (Fit + 1) * Large),
    %% a sender that would not wait for room is refused only at max_buffered_bytes
    [begin
         Policy = RT#runtime{overload = P},
         [?assertEqual(ok, convoy_held:hold(H, Large, Policy)) || _ <- lists:seq(1, Fit + 1)],
         ?assert(convoy_held:has_room(H, Large, Policy)),
         ok = convoy_held:release(H, Fit + 1, (Fit + 1) * Large)
     end || P <- [drop, error]].

%% A row is closed only when nothing is held; a closed one refuses holds (undone,
%% so its reading does not move) and stays closed.
close_test() ->
    H = convoy_held:new(),
    ok = convoy_held:hold(H, 5, infinity, infinity),
    ?assertNot(convoy_held:try_close(H)),
    ?assertNot(convoy_held:is_closed(H)),
    ?assertEqual({1, 5}, convoy_held:read(H)),
    ok = convoy_held:release(H, 1, 5),
    ?assert(convoy_held:try_close(H)),
    ?assert(convoy_held:is_closed(H)),
    ?assertEqual(closed, convoy_held:hold(H, 5, infinity, infinity)),
    ?assertEqual({0, 0}, convoy_held:read(H)),
    ?assert(convoy_held:is_closed(H)).

%% Senders racing a close: each either holds (and the close fails) or gets closed;
%% the final reading accounts for exactly the holds that succeeded.
race_test() ->
    H = convoy_held:new(),
    Self = self(),
    Pids = [spawn_link(fun() ->
                               R = [convoy_held:hold(H, 1, infinity, infinity) || _ <- lists:seq(1, 1000)],
                               Self ! {self(), length([ok || ok <- R])}
                       end) || _ <- lists:seq(1, 4)],
    Closed = [convoy_held:try_close(H) || _ <- lists:seq(1, 200)],
    Oks = lists:sum([receive {P, N} -> N end || P <- Pids]),
    case lists:member(true, Closed) of
        true -> ?assert(convoy_held:is_closed(H));
        false -> ?assertNot(convoy_held:is_closed(H))
    end,
    ?assertEqual({Oks, Oks}, convoy_held:read(H)).

%% Closing a closed row, or a row holding only bytes or only messages, fails.
close_needs_both_empty_test() ->
    H = convoy_held:new(),
    ?assert(convoy_held:is_empty(H)),
    ok = convoy_held:hold(H, 0, infinity, infinity),
    ?assertNot(convoy_held:is_empty(H)),
    ?assertNot(convoy_held:try_close(H)),
    ok = convoy_held:release(H, 1, 0),
    ok = convoy_held:hold(H, 7, infinity, infinity),
    ok = convoy_held:release(H, 1, 0), % bytes left behind by a part release
    ?assertEqual({0, 7}, convoy_held:read(H)),
    ?assertNot(convoy_held:try_close(H)),
    ok = convoy_held:release(H, 0, 7),
    ok = convoy_held:release(H, 0, 0),
    ?assert(convoy_held:try_close(H)),
    ?assertNot(convoy_held:try_close(H)),
    ?assert(convoy_held:is_closed(H)),
    ?assertNot(convoy_held:is_empty(H)).

%% Part of a run released, then the rest: the lane releases runs, not holds.
release_runs_test() ->
    H = convoy_held:new(),
    [ok = convoy_held:hold(H, B, 3, infinity) || B <- [10, 20, 30]],
    ?assertEqual(full, convoy_held:hold(H, 0, 3, infinity)),
    ok = convoy_held:release(H, 2, 40),
    ?assertEqual({1, 20}, convoy_held:read(H)),
    ?assertNot(convoy_held:has_room(H, 1000, 3, 100)), % only alone past the bound
    ?assert(convoy_held:has_room(H, 80, 3, 100)),
    ok = convoy_held:release(H, 1, 20),
    ?assert(convoy_held:is_empty(H)).

%% A claim is kept within the bound and put back past it; a row with a share
%% is not closed, and a closed row refuses every claim.
shares_test() ->
    S = convoy_held:new_shares(2),
    ?assert(convoy_held:claim_share(S, 1, 0, 60, 100)),
    ?assertEqual(60, convoy_held:others_share(S, 2)),
    ?assertNot(convoy_held:claim_share(S, 2, 0, 50, 100)),
    ?assertEqual(0, convoy_held:others_share(S, 1)),
    ?assert(convoy_held:claim_share(S, 2, 0, 40, 100)),
    ?assert(convoy_held:claim_share(S, 2, 40, 400, infinity)),
    ?assertEqual(460, convoy_held:shares(S)),
    ?assertNot(convoy_held:try_close_shares(S)),
    ok = convoy_held:set_share(S, 1, 0),
    ok = convoy_held:set_share(S, 2, 0),
    ?assert(convoy_held:try_close_shares(S)),
    ?assertNot(convoy_held:claim_share(S, 1, 0, 1, infinity)),
    ?assertEqual(0, convoy_held:shares(S)).

%% The fields' widths bound what is held, whatever the configured bounds; the byte
%% field full does not spill into the message count.
ceiling_test() ->
    {MaxN, MaxB} = convoy_held:ceiling(),
    ?assertEqual({(1 bsl 26) - 1, (1 bsl 36) - 1}, {MaxN, MaxB}),
    H = convoy_held:new(),
    ?assertEqual(full, convoy_held:hold(H, MaxB + 1, infinity, infinity)),
    ?assertNot(convoy_held:has_room(H, MaxB + 1, infinity, infinity)),
    ?assertEqual(ok, convoy_held:hold(H, MaxB, infinity, infinity)),
    ?assertEqual({1, MaxB}, convoy_held:read(H)),
    ?assertEqual(ok, convoy_held:hold(H, 0, infinity, infinity)),
    ?assertEqual(full, convoy_held:hold(H, 1, infinity, infinity)),
    ?assertEqual({2, MaxB}, convoy_held:read(H)),
    ok = convoy_held:release(H, 2, MaxB),
    ?assert(convoy_held:is_empty(H)),
    ok = convoy_held:set(H, MaxN - 1, 5),
    ?assertEqual(ok, convoy_held:hold(H, 1, infinity, infinity)),
    ?assertEqual(full, convoy_held:hold(H, 0, infinity, infinity)),
    ?assertEqual(full, convoy_held:hold(H, 0, MaxN + 10, infinity)),
    ?assertEqual({MaxN, 6}, convoy_held:read(H)),
    ?assertNot(convoy_held:try_close(H)),
    ok = convoy_held:release(H, MaxN, 6),
    ?assert(convoy_held:try_close(H)).

%% Several senders holding and releasing while another tries to close the row:
%% no hold is lost or counted twice, the bounds are never passed, and the row ends
%% empty, or closed if (and only if) one close succeeded (then every later hold is
%% refused).
concurrent_close_test_() ->
    {timeout, 120, [fun() -> concurrent_close(Seed) end || Seed <- lists:seq(1, 6)]}.

concurrent_close(Seed) ->
    H = convoy_held:new(),
    MaxN = 12,
    MaxB = 600,
    Self = self(),
    Workers = [spawn_link(fun() ->
                                  _ = rand:seed(exsss, {Seed, I, 7}),
                                  receive go -> ok end,
                                  Counts = worker(H, MaxN, MaxB, 2000, [], #{}),
                                  Self ! {started, self()},
                                  Self ! {self(), worker(H, MaxN, MaxB, 20000, [], Counts)}
                          end) || I <- lists:seq(1, 4)],
    Watcher = spawn_link(fun() -> watch(H, MaxN, MaxB) end),
    _ = [W ! go || W <- Workers],
    _ = [receive {started, W} -> ok end || W <- Workers],
    Closes = closer(H, Workers, Seed, []),
    Counts = [receive {W, C} -> C end || W <- Workers],
    Watcher ! {stop, self()},
    receive {Watcher, Samples} -> ?assert(Samples > 0) end,
    Closed = lists:member(true, Closes),
    ?assert(length([true || true <- Closes]) =< 1),
    ?assertEqual({0, 0}, convoy_held:read(H)),
    ?assertEqual(Closed, convoy_held:is_closed(H)),
    ?assertEqual(not Closed, convoy_held:is_empty(H)),
    SawClosed = lists:any(fun(C) -> maps:get(closed, C, 0) > 0 end, Counts),
    ?assert(Closed orelse not SawClosed),
    ?assert(lists:all(fun(C) -> maps:get(ok, C, 0) > 0 end, Counts)),
    ?assertEqual(case Closed of true -> closed; false -> ok end,
                 convoy_held:hold(H, 1, infinity, infinity)).

%% Holds a few messages, releases them in runs; after a `closed' it holds nothing
%% and every hold after is refused too.
worker(_H, _MaxN, _MaxB, 0, [], Counts) ->
    Counts;
worker(H, MaxN, MaxB, 0, Held, Counts) ->
    ok = convoy_held:release(H, length(Held), lists:sum(Held)),
    worker(H, MaxN, MaxB, 0, [], Counts);
worker(H, MaxN, MaxB, Left, Held, Counts) ->
    case rand:uniform(3) of
        3 when Held =/= [] ->
            {Run, Rest} = lists:split(rand:uniform(length(Held)), Held),
            ok = convoy_held:release(H, length(Run), lists:sum(Run)),
            worker(H, MaxN, MaxB, Left - 1, Rest, Counts);
        _ ->
            Bytes = rand:uniform(MaxB div 5) - 1,
            case convoy_held:hold(H, Bytes, MaxN, MaxB) of
                ok ->
                    ?assertEqual(0, maps:get(closed, Counts, 0)),
                    worker(H, MaxN, MaxB, Left - 1, [Bytes | Held], bump(ok, Counts));
                full ->
                    worker(H, MaxN, MaxB, Left - 1, Held, bump(full, Counts));
                closed ->
                    ?assertEqual([], Held),
                    worker(H, MaxN, MaxB, Left - 1, Held, bump(closed, Counts))
            end
    end.

bump(K, Counts) -> maps:update_with(K, fun(V) -> V + 1 end, 1, Counts).

%% Once every worker has held some, tries to close until it succeeds or every
%% worker is done (mid-run on some seeds, after the end on others; every third seed
%% never tries).
closer(H, Workers, Seed, Acc) ->
    case lists:all(fun(W) -> not is_process_alive(W) end, Workers) orelse lists:member(true, Acc) of
        true when Seed rem 3 =:= 0 -> Acc; % some runs never close
        true -> lists:reverse([convoy_held:try_close(H) | Acc]);
        false when Seed rem 3 =:= 0 -> erlang:yield(), closer(H, Workers, Seed, Acc);
        false -> erlang:yield(), closer(H, Workers, Seed, [convoy_held:try_close(H) | Acc])
    end.

watch(H, MaxN, MaxB) -> watch(H, MaxN, MaxB, 0).

watch(H, MaxN, MaxB, Samples) ->
    {N, B} = convoy_held:read(H),
    ?assert(N >= 0 andalso N =< MaxN),
    ?assert(B >= 0 andalso B =< MaxB),
    receive
        {stop, From} -> From ! {self(), Samples + 1}
    after 0 ->
        watch(H, MaxN, MaxB, Samples + 1)
    end.
