%% PropEr property of `convoy_held', run from EUnit: random sequences of holds,
%% holds of several messages at once, releases, closes and room checks give what a model of two plain counters and a
%% closed flag gives, from empty rows and from rows at the fields' ceiling (holds
%% past it, past the bounds, of 0 bytes, releases of nothing, closes of held,
%% empty and closed rows).
%% PropEr 1.2 cannot report an exception raised inside a property on OTP 25 (it
%% calls erlang:get_stacktrace/0), so the property catches and prints its own.
-module(prop_convoy_held_tests).

-export([prop_model/0]).

-include_lib("proper/include/proper.hrl").
-include_lib("eunit/include/eunit.hrl").

model_test_() ->
    {timeout, 120,
     ?_assertEqual(ok, convoy_prop:check(prop_model(),
                                         [{numtests, 5000}, {to_file, user}, {max_shrinks, 300}]))}.

prop_model() ->
    ?FORALL({Start, Ops}, {start(), list(op())},
            begin
                Result = try run(Start, Ops) catch C:R:St -> {crashed, C, R, St} end,
                ?WHENFAIL(io:format(user, "~p ~P~n=> ~P~n", [Start, Ops, 60, Result, 60]),
                          Result =:= true)
            end).

%%--------------------------------------------------------------------
%% Generators

ceiling() -> convoy_held:ceiling().

start() ->
    {MaxN, MaxB} = ceiling(),
    oneof([{0, 0},
           {range(0, 5), range(0, 200)},
           {near(MaxN, 0, 3), range(0, 200)},
           {range(0, 5), near(MaxB, 0, 200)},
           {near(MaxN, 0, 3), near(MaxB, 0, 200)}]).

%% Ceil - D, D in Lo..Hi.
near(Ceil, Lo, Hi) -> ?LET(D, range(Lo, Hi), Ceil - D).

op() ->
    frequency([{6, {hold, bytes(), bound(msgs), bound(bytes)}},
               {3, {hold_many, range(1, 12), bytes(), bound(msgs), bound(bytes)}},
               {3, {release, range(0, 100), range(0, 100)}},
               {1, try_close},
               {2, {has_room, bytes(), bound(msgs), bound(bytes)}}]).

bytes() ->
    {_, MaxB} = ceiling(),
    oneof([0, range(1, 100), near(MaxB, 0, 100), near(MaxB, -3, -1)]).

bound(Field) ->
    Ceil = case Field of
               msgs -> element(1, ceiling());
               bytes -> element(2, ceiling())
           end,
    oneof([infinity, range(1, 8), range(1, 300), near(Ceil, -3, 3)]).

%%--------------------------------------------------------------------
%% The model: {Messages, Bytes, Closed}

run({N, B}, Ops) ->
    H = convoy_held:new(),
    ok = convoy_held:set(H, N, B),
    run(H, {N, B, false}, Ops).

run(_H, _M, []) ->
    true;
run(H, M, [Op | Ops]) ->
    {Got, Expected, M1} = step(H, M, Op),
    case Got =:= Expected andalso observed(H) =:= observed(M1) of
        true -> run(H, M1, Ops);
        false -> {Op, M, {got, Got, observed(H)}, {expected, Expected, observed(M1)}}
    end.

step(H, M = {N, B, Closed}, {hold, Bytes, MaxN, MaxB}) ->
    Got = convoy_held:hold(H, Bytes, MaxN, MaxB),
    if
        Closed -> {Got, closed, M};
        true ->
            case fits(N, B, Bytes, MaxN, MaxB) of
                true -> {Got, ok, {N + 1, B + Bytes, false}};
                false -> {Got, full, M}
            end
    end;
step(H, M = {N, B, Closed}, {hold_many, K, Bytes, MaxN, MaxB}) ->
    Got = convoy_held:hold_many(H, K, Bytes, MaxN, MaxB),
    if
        Closed -> {Got, closed, M};
        true ->
            case fits_many(N, B, K, Bytes, MaxN, MaxB) of
                true -> {Got, ok, {N + K, B + Bytes, false}};
                false -> {Got, full, M}
            end
    end;
step(H, {N, B, Closed}, {release, PctN, PctB}) ->
    %% As the lane does: a run of K held messages and at most their bytes, all of
    %% them with the last message.
    K = N * PctN div 100,
    Bytes = case K =:= N of
                true -> B;
                false -> B * PctB div 100
            end,
    {convoy_held:release(H, K, Bytes), ok, {N - K, B - Bytes, Closed}};
step(H, {N, B, Closed}, try_close) ->
    Empty = N =:= 0 andalso B =:= 0 andalso not Closed,
    {convoy_held:try_close(H), Empty, {N, B, Closed orelse Empty}};
step(H, M = {N, B, _Closed}, {has_room, Bytes, MaxN, MaxB}) ->
    {convoy_held:has_room(H, Bytes, MaxN, MaxB), fits(N, B, Bytes, MaxN, MaxB), M}.

%% Room for one more message: under both ceilings, within the message bound, and
%% within the byte bound unless it is alone in holding bytes.
fits(N, B, Bytes, MaxN, MaxB) ->
    {CeilN, CeilB} = ceiling(),
    N + 1 =< CeilN andalso B + Bytes =< CeilB
        andalso (MaxN =:= infinity orelse N + 1 =< MaxN)
        andalso (B =:= 0 orelse MaxB =:= infinity orelse B + Bytes =< MaxB).

%% Room for K more messages at once: one is `fits/5'; more must all be within
%% both bounds (only a message alone may exceed the byte bound).
fits_many(N, B, 1, Bytes, MaxN, MaxB) ->
    fits(N, B, Bytes, MaxN, MaxB);
fits_many(N, B, K, Bytes, MaxN, MaxB) ->
    {CeilN, CeilB} = ceiling(),
    N + K =< CeilN andalso B + Bytes =< CeilB
        andalso (MaxN =:= infinity orelse N + K =< MaxN)
        andalso (MaxB =:= infinity orelse B + Bytes =< MaxB).

observed({N, B, Closed}) ->
    {{N, B}, N =:= 0 andalso B =:= 0 andalso not Closed, Closed};
observed(H) ->
    {convoy_held:read(H), convoy_held:is_empty(H), convoy_held:is_closed(H)}.
