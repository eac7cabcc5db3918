%% Pure statistics for the harness: medians, percentiles, geometric means and the
%% summary of repeated runs (median with min-max; ratios to the baseline taken
%% repeat by repeat, then their median).
-module(convoy_bench_stats).

-export([median/1, percentile/2, geomean/1, spread/1, ratios/2]).

-type spread() :: #{median := float(), min := number(), max := number(), n := pos_integer()}.
-export_type([spread/0]).

%% @doc Median of a non-empty list of numbers.
-spec median([number(), ...]) -> float().
median(Xs) ->
    S = lists:sort(Xs),
    N = length(S),
    case N rem 2 of
        1 -> float(lists:nth(N div 2 + 1, S));
        0 -> (lists:nth(N div 2, S) + lists:nth(N div 2 + 1, S)) / 2
    end.

%% @doc Nearest-rank percentile `P' (0-100) of an already sorted non-empty list.
-spec percentile(number(), [number(), ...]) -> number().
percentile(P, Sorted) ->
    N = length(Sorted),
    %% The epsilon keeps 99.9% of 1000 at rank 999 despite float rounding.
    Rank = max(1, min(N, ceil(P * N / 100 - 1.0e-9))),
    lists:nth(Rank, Sorted).

%% @doc Geometric mean of positive numbers (the mean of ratios that treats a gain
%% and the matching loss alike).
-spec geomean([number(), ...]) -> float().
geomean(Xs) ->
    math:exp(lists:sum([math:log(X) || X <- Xs]) / length(Xs)).

%% @doc Median, min and max of a non-empty list; `none' for an empty one.
-spec spread([number()]) -> spread() | none.
spread([]) -> none;
spread(Xs) -> #{median => median(Xs), min => lists:min(Xs), max => lists:max(Xs),
                n => length(Xs)}.

%% @doc Per-repeat ratios `Value / Base', pairing the two lists by repeat
%% (`[{Repeat, Value}]'); repeats missing on either side or with a zero base are
%% left out. Returns their spread.
-spec ratios([{pos_integer(), number()}], [{pos_integer(), number()}]) -> spread() | none.
ratios(Values, Base) ->
    spread([V / B || {R, V} <- Values, {R2, B} <- Base, R =:= R2, B /= 0]).

-ifdef(TEST).
-include_lib("eunit/include/eunit.hrl").

median_test() ->
    ?assertEqual(2.0, median([3, 1, 2])),
    ?assertEqual(2.5, median([4, 1, 2, 3])).

percentile_test() ->
    L = lists:seq(1, 1000),
    ?assertEqual(500, percentile(50, L)),
    ?assertEqual(990, percentile(99, L)),
    ?assertEqual(999, percentile(99.9, L)),
    ?assertEqual(7, percentile(99, [7])).

ratios_test() ->
    ?assertMatch(#{median := 2.0, min := 1.0, max := 3.0},
                 ratios([{1, 2}, {2, 4}, {3, 9}], [{1, 2}, {2, 2}, {3, 3}])),
    ?assertEqual(none, ratios([{1, 2}], [{2, 2}])).
-endif.
