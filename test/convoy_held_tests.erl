%% convoy_held: room within the bounds, release, and the forgetting protocol.
-module(convoy_held_tests).

-include_lib("eunit/include/eunit.hrl").

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

%% A message alone may exceed the byte bound; a second one may not.
byte_bound_test() ->
    H = convoy_held:new(),
    ?assertEqual(ok, convoy_held:hold(H, 500, infinity, 100)),
    ?assertEqual(full, convoy_held:hold(H, 1, infinity, 100)),
    ?assertEqual({1, 500}, convoy_held:read(H)).

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
