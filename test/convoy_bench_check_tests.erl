%% EUnit tests of `convoy_bench_check' (the `--check' gate of bin/convoy-bench) on
%% fabricated summaries: each tolerance's edge, failed and unmeasured cells, cells
%% without a ratio, and the count line. (Here rather than inside the module: the
%% bench/ modules are compiled in the test profile but `rebar3 eunit' runs the
%% application's modules and test/.)
-module(convoy_bench_check_tests).

-include_lib("eunit/include/eunit.hrl").

%% A fabricated pairs-like scenario: one point, compared figures rt/s, p50, p99
%% and p99.9 (p99.9 is compared but not checked).
scenario(Rows) ->
    #{name => pairs, baseline => <<"plain">>,
      spec => #{figures => [{rt_s, <<"rt/s">>, rate}, {p50_us, <<"p50">>, us},
                            {p99_us, <<"p99">>, us}, {p999_us, <<"p99.9">>, us}],
                ratio => [rt_s, p50_us, p99_us, p999_us]},
      summary => Rows}.

base_row() ->
    #{variant => <<"plain">>, point => <<"1 pairs, req">>, status => ok, note => <<>>,
      ratios => #{}}.

row(V, Ratios) ->
    #{variant => V, point => <<"1 pairs, req">>, status => ok, note => <<>>,
      ratios => maps:map(fun(_, R) -> #{median => R, min => R, max => R, n => 1} end,
                         Ratios)}.

check_one(Ratios) ->
    convoy_bench_check:check([scenario([base_row(), row(<<"convoy">>, Ratios)])], [<<"convoy">>]).

failing(Result) ->
    lists:sort([{K, R} || #{key := K, ratio := R} <- maps:get(failures, Result)]).

ok_ratios() -> #{rt_s => 1.0, p50_us => 1.0, p99_us => 1.0, p999_us => 9.0}.

tolerances_test() ->
    ?assertEqual(#{throughput_min => 0.95, p50_max => 1.10, p99_max => 1.25},
                 convoy_bench_check:tolerances()).

all_within_test() ->
    R = check_one(ok_ratios()),
    ?assertMatch(#{cells := 3, within := 3, failures := []}, R),
    ?assertNotEqual(nomatch, string:find(iolist_to_binary(convoy_bench_check:text(R)),
                                         "convoy vs plain: 3 of 3 cells within tolerance\n")).

throughput_edge_test() ->
    ?assertEqual([], failing(check_one((ok_ratios())#{rt_s => 0.95}))),
    ?assertEqual([{rt_s, 0.9499}], failing(check_one((ok_ratios())#{rt_s => 0.9499}))),
    ?assertEqual([], failing(check_one((ok_ratios())#{rt_s => 5.0}))).

p50_edge_test() ->
    ?assertEqual([], failing(check_one((ok_ratios())#{p50_us => 1.10}))),
    ?assertEqual([{p50_us, 1.1001}], failing(check_one((ok_ratios())#{p50_us => 1.1001}))),
    ?assertEqual([], failing(check_one((ok_ratios())#{p50_us => 0.2}))).

p99_edge_test() ->
    ?assertEqual([], failing(check_one((ok_ratios())#{p99_us => 1.25}))),
    ?assertEqual([{p99_us, 1.2501}], failing(check_one((ok_ratios())#{p99_us => 1.2501}))),
    %% p50's limit does not apply to p99.
    ?assertEqual([], failing(check_one((ok_ratios())#{p99_us => 1.2}))).

throughput_units_test() ->
    S = #{name => sizes, baseline => <<"plain">>,
          spec => #{figures => [{msg_s, <<"msg/s">>, rate}, {mb_s, <<"MB/s">>, mbs},
                                {round_ms, <<"ms/round">>, ms}],
                    ratio => [mb_s, round_ms]},
          summary => [base_row(), row(<<"convoy">>, #{mb_s => 0.5, round_ms => 9.0})]},
    R = convoy_bench_check:check([S], [<<"convoy">>]),
    ?assertMatch(#{cells := 1, within := 0}, R),
    ?assertEqual([{mb_s, 0.5}], failing(R)).

failed_cell_test() ->
    Failed = #{variant => <<"convoy">>, point => <<"1 pairs, req">>, status => error,
               note => <<"deadline 20000 ms">>, ratios => #{}},
    R = convoy_bench_check:check([scenario([base_row(), Failed])], [<<"convoy">>]),
    ?assertMatch(#{cells := 3, within := 0}, R),
    [?assertMatch(#{ratio := null, why := <<"FAILED: deadline 20000 ms">>}, C)
     || C <- maps:get(failures, R)],
    Text = iolist_to_binary(convoy_bench_check:text(R)),
    ?assertNotEqual(nomatch, string:find(Text, "convoy vs plain: 0 of 3 cells within tolerance")),
    ?assertNotEqual(nomatch, string:find(Text, "FAILED: deadline 20000 ms")).

no_ratio_test() ->
    BaseFailed = (base_row())#{status => error, note => <<"boom">>},
    R = convoy_bench_check:check([scenario([BaseFailed, row(<<"convoy">>, #{})])],
                                 [<<"convoy">>]),
    ?assertMatch(#{cells := 3, within := 0}, R),
    [?assertMatch(#{ratio := null, why := <<"no ratio: plain FAILED (boom)">>}, C)
     || C <- maps:get(failures, R)],
    Unmeasured = (row(<<"convoy">>, #{}))#{status => unavailable, note => <<"why">>},
    R2 = convoy_bench_check:check([scenario([base_row(), Unmeasured])], [<<"convoy">>]),
    [?assertMatch(#{why := <<"not measured (unavailable): why">>}, C)
     || C <- maps:get(failures, R2)].

count_line_test() ->
    %% Two convoy variants, one point each: 6 cells, 2 failing.
    Rows = [base_row(), row(<<"convoy">>, ok_ratios()),
            row(<<"convoy[lanes=2]">>, (ok_ratios())#{rt_s => 0.5, p99_us => 2.0}),
            row(<<"delay_send">>, #{rt_s => 0.1})],
    R = convoy_bench_check:check([scenario(Rows)], [<<"convoy">>, <<"convoy[lanes=2]">>]),
    ?assertMatch(#{cells := 6, within := 4}, R),
    Text = iolist_to_binary(convoy_bench_check:text(R)),
    ?assertNotEqual(nomatch, string:find(Text, "convoy vs plain: 4 of 6 cells within tolerance\n")),
    ?assertNotEqual(nomatch, string:find(Text, "tolerances: throughput")),
    %% One line per failing cell, after the count line: the header and two rows.
    [_, After] = string:split(Text, "within tolerance\n"),
    ?assertEqual(3, length(string:lexemes(After, "\n"))),
    ?assertNotEqual(nomatch, string:find(After, "convoy[lanes=2]")),
    ?assertEqual(nomatch, string:find(After, "delay_send")),
    ?assertEqual(#{cells => 0, within => 0, failures => [], baseline => <<"plain">>,
                   tolerances => convoy_bench_check:tolerances()},
                 convoy_bench_check:check([scenario(Rows)], [])).

%% --noise: plain_again's check is printed after convoy's, with its own count line
%% and failing cells.
noise_text_test() ->
    Rows = [base_row(), row(<<"convoy">>, ok_ratios()),
            row(<<"plain_again">>, (ok_ratios())#{rt_s => 0.9})],
    Convoy = convoy_bench_check:check([scenario(Rows)], [<<"convoy">>]),
    Noise = convoy_bench_check:check([scenario(Rows)], [<<"plain_again">>]),
    ?assertMatch(#{cells := 3, within := 2}, Noise),
    Text = iolist_to_binary(convoy_bench_check:text(Convoy#{noise => Noise})),
    [Before, After] = string:split(Text, "plain_again vs plain"),
    ?assertNotEqual(nomatch, string:find(Before, "convoy vs plain: 3 of 3 cells within tolerance\n")),
    ?assertNotEqual(nomatch, string:find(After, "2 of 3 cells within tolerance\n")),
    ?assertNotEqual(nomatch, string:find(After, "0.90")),
    ?assertEqual(nomatch, string:find(iolist_to_binary(convoy_bench_check:text(Convoy)),
                                      "plain_again")).

%% check/3: each failing convoy cell carries `!''s ratio against itself at the
%% same point and figure (in range or not), printed in its row.
noise_beside_failures_test() ->
    Rows = [base_row(), row(<<"convoy">>, (ok_ratios())#{rt_s => 0.93, p99_us => 1.4}),
            row(<<"plain_again">>, (ok_ratios())#{rt_s => 0.941, p99_us => 1.0})],
    R = convoy_bench_check:check([scenario(Rows)], [<<"convoy">>], [<<"plain_again">>]),
    ?assertEqual([{p99_us, 1.0}, {rt_s, 0.941}],
                 lists:sort([{K, N} || #{key := K, noise := N} <- maps:get(failures, R)])),
    ?assertMatch(#{noise := #{cells := 3, within := 2}}, R),
    [_, Rows1] = string:split(iolist_to_binary(convoy_bench_check:text(R)),
                              "cells within tolerance\n"),
    [Convoy | _] = string:split(Rows1, "plain_again vs plain"),
    [Header, Rt, P99] = string:lexemes(Convoy, "\n"),
    ?assertNotEqual(nomatch, string:find(Header, "! again")),
    ?assertNotEqual(nomatch, string:find(Rt, "0.930  >= 0.95  0.941")),
    ?assertNotEqual(nomatch, string:find(P99, "1.400  <= 1.25  1.000")),
    %% No plain_again row at that point: no ratio to show.
    R2 = convoy_bench_check:check([scenario(lists:droplast(Rows))], [<<"convoy">>],
                                  [<<"plain_again">>]),
    ?assertEqual([null, null], [N || #{noise := N} <- maps:get(failures, R2)]).
