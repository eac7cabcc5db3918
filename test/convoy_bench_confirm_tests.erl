%% EUnit tests of `convoy_bench_confirm' (`--check --confirm N'): which cells are
%% measured again, and how the new repeats are numbered. (Here rather than inside
%% the module: `rebar3 eunit' runs the application's modules and test/.)
-module(convoy_bench_confirm_tests).

-include_lib("eunit/include/eunit.hrl").

%% Every failing cell with a ratio names its point and variant once (a p50 at 1.3x
%% as well as a throughput at 0.8x); a cell without a ratio (FAILED, unmeasured)
%% is not measured again.
targets_test() ->
    F = fun(S, P, V, R) -> #{scenario => S, point => P, variant => V, ratio => R} end,
    ?assertEqual(#{pairs => #{points => [<<"16 pairs">>, <<"4 pairs">>],
                              variants => [<<"convoy">>, <<"convoy[lanes=2]">>]}},
                 convoy_bench_confirm:targets(
                   [F(pairs, <<"4 pairs">>, <<"convoy">>, 0.8),
                    F(pairs, <<"16 pairs">>, <<"convoy[lanes=2]">>, 0.9),
                    F(pairs, <<"4 pairs">>, <<"convoy">>, 1.3),
                    F(flood, <<"200k">>, <<"convoy">>, null)])).

%% New repeats follow the old ones, so each still pairs a variant with the
%% baseline measured beside it.
renumber_test() ->
    Old = [#{repeat => 1}, #{repeat => 3}, #{repeat => 2}],
    ?assertEqual([#{repeat => 4}, #{repeat => 5}],
                 convoy_bench_confirm:renumber([#{repeat => 1}, #{repeat => 2}], Old)),
    ?assertEqual([#{repeat => 1}], convoy_bench_confirm:renumber([#{repeat => 1}], [])).
