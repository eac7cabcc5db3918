%% @private
%% Is a term "large"? Pure.
%%
%% Deciding must cost a small send almost nothing, so instead of computing the
%% encoded size (`erlang:external_size/1' walks the whole term every time) this walks
%% the term only until its estimated size passes the threshold. The estimate counts
%% binary bytes exactly and 8 bytes for every other word, close to the external
%% format of the terms that make messages large (binaries, long lists, big tuples).
-module(convoy_size).

-export([is_large/2, measure/2, estimate/1]).

-define(WORD, 8).

%% @doc True when `Term''s estimated size is at least `Threshold' bytes.
-spec is_large(term(), non_neg_integer() | infinity) -> boolean().
is_large(_Term, infinity) -> false;
is_large(_Term, 0) -> true;
is_large(Term, Threshold) -> walk(Term, [], Threshold) =< 0.

%% @doc `{small, EstimatedBytes}' below `Threshold', else `large'; one walk, which
%% stops at the threshold.
-spec measure(term(), non_neg_integer() | infinity) -> {small, non_neg_integer()} | large.
measure(Term, infinity) ->
    {small, estimate(Term)};
measure(_Term, 0) ->
    large;
measure(Term, Threshold) ->
    case walk(Term, [], Threshold) of
        Left when Left > 0 -> {small, Threshold - Left};
        _ -> large
    end.

%% @doc The whole estimate, in bytes.
-spec estimate(term()) -> non_neg_integer().
estimate(Term) -> -walk(Term, [], -1 bsl 62) - (1 bsl 62).

%% Left counts down from the budget; the walk ends early once it reaches zero.
%% Stack holds the parts still to visit: {term, T}, or {tuple, Tuple, NextIndex}
%% (tagged, so no term of the message can pass for a frame).
walk(_T, _Stack, Left) when Left =< 0, Left > -1 bsl 61 -> Left;
walk(T, Stack, Left) when is_bitstring(T) -> pop(Stack, Left - byte_size(T) - ?WORD);
walk([H | T], Stack, Left) -> walk(H, [{term, T} | Stack], Left - ?WORD);
walk(T, Stack, Left) when is_tuple(T), tuple_size(T) > 0 -> pop([{tuple, T, 1} | Stack], Left - ?WORD);
walk(T, Stack, Left) when is_map(T) -> walk(maps:to_list(T), Stack, Left - ?WORD);
walk(_T, Stack, Left) -> pop(Stack, Left - ?WORD).

pop([], Left) -> Left;
pop([{tuple, T, I} | Stack], Left) when I > tuple_size(T) -> pop(Stack, Left);
pop([{tuple, T, I} | Stack], Left) -> walk(element(I, T), [{tuple, T, I + 1} | Stack], Left);
pop([{term, T} | Stack], Left) -> walk(T, Stack, Left).

-ifdef(TEST).
-include_lib("eunit/include/eunit.hrl").

small_is_small_test() ->
    ?assertNot(is_large({hello, self(), <<"abc">>, 123}, 65536)),
    ?assertNot(is_large(anything, infinity)),
    ?assert(is_large(a, 0)).

big_binary_test() ->
    ?assert(is_large(<<0:70000/unit:8>>, 65536)),
    ?assert(is_large({data, <<0:70000/unit:8>>}, 65536)),
    ?assertNot(is_large({data, <<0:1000/unit:8>>}, 65536)).

long_list_test() ->
    ?assert(is_large(lists:seq(1, 10000), 65536)),
    ?assertNot(is_large(lists:seq(1, 100), 65536)).

big_tuple_and_map_test() ->
    ?assert(is_large(list_to_tuple(lists:seq(1, 10000)), 65536)),
    ?assert(is_large(maps:from_list([{I, I} || I <- lists:seq(1, 5000)]), 65536)).

measure_test() ->
    ?assertEqual({small, estimate({a, <<"xyz">>})}, measure({a, <<"xyz">>}, 1000)),
    ?assertEqual(large, measure(<<0:8000>>, 1000)),
    ?assertEqual({small, estimate(<<0:8000>>)}, measure(<<0:8000>>, infinity)),
    ?assertEqual(large, measure(a, 0)).

improper_list_test() ->
    ?assertEqual(estimate([a | {b, 1}]), estimate([a | {b, 2}])),
    ?assert(estimate([a | {{p, q, r}, 1}]) > estimate([a | {b, 1}])),
    ?assertNot(is_large([a | {b, 1}], 1000)).

estimate_close_to_external_size_test() ->
    [begin
         E = estimate(T), X = erlang:external_size(T),
         ?assert(E >= X div 2 andalso E =< X * 9)
     end || T <- [<<0:100000/unit:8>>, lists:seq(1, 5000), {a, <<1:800>>, [x, y]}]].
-endif.
