%% `--check': the regression gate of issue 8 ("never slower than plain `!'").
%%
%% A pure function over a run's scenario summaries. Every compared figure of every
%% point of every convoy variant is a cell; its value is the ratio the runner
%% already computed, the median over repeats of convoy / baseline in the same
%% repeat (the baseline is `plain' across nodes, `local' on one node). A cell is
%% within tolerance when
%%
%% <ul>
%% <li>a throughput-like figure (unit `rate' or `mbs': msg/s, rt/s, MB/s,
%%   deliveries/s, msg/min) is at least `?MIN_THROUGHPUT' times the baseline;</li>
%% <li>p50 is at most `?MAX_P50' times the baseline;</li>
%% <li>p99 is at most `?MAX_P99' times the baseline.</li>
%% </ul>
%%
%% Other compared figures are not checked. A convoy cell that FAILED, was not
%% measured, or has no ratio (e.g. its baseline failed) is outside tolerance, with
%% the reason. The edges are inside: 0.95x throughput passes, 0.9499x does not.
-module(convoy_bench_check).

-export([check/2, tolerances/0, text/1]).

-define(MIN_THROUGHPUT, 0.95).
-define(MAX_P50, 1.10).
-define(MAX_P99, 1.25).

-type rule() :: {at_least | at_most, float()}.
-type cell() :: #{scenario := atom(), point := binary(), variant := binary(),
                  figure := binary(), key := atom(), ratio := float() | null,
                  limit := binary(), within := boolean(), why := binary()}.
-type result() :: #{baseline := binary(), tolerances := map(),
                    cells := non_neg_integer(), within := non_neg_integer(),
                    failures := [cell()]}.
-export_type([result/0]).

%% @doc The tolerances, as printed and written to results.json.
-spec tolerances() -> #{throughput_min := float(), p50_max := float(), p99_max := float()}.
tolerances() ->
    #{throughput_min => ?MIN_THROUGHPUT, p50_max => ?MAX_P50, p99_max => ?MAX_P99}.

%% @doc Check every cell of the variants named `Convoy' in `Scenarios' (scenario
%% results: `name', `spec' (its `figures' and `ratio'), `baseline', `summary').
-spec check([map()], [binary()]) -> result().
check(Scenarios, Convoy) ->
    Cells = lists:append([scenario_cells(S, Convoy) || S <- Scenarios]),
    #{baseline => <<"plain">>, tolerances => tolerances(),
      cells => length(Cells),
      within => length([C || C = #{within := true} <- Cells]),
      failures => [C || C = #{within := false} <- Cells]}.

scenario_cells(#{name := Name, spec := #{figures := Figs, ratio := Compared},
                 baseline := Base, summary := Summary}, Convoy) ->
    Checked = [{F, Label, Rule} || F <- Compared,
                                   {F1, Label, Unit} <- Figs, F1 =:= F,
                                   Rule <- [rule(F, Unit)], Rule =/= none],
    [cell(Name, Row, baseline_row(Base, P, Summary), Base, Fig)
     || Row = #{variant := V, point := P} <- Summary,
        lists:member(V, Convoy),
        Fig <- Checked].

%% Which figures are checked, and against what.
-spec rule(atom(), convoy_bench_scenarios:unit()) -> rule() | none.
rule(p50_us, _) -> {at_most, ?MAX_P50};
rule(p99_us, _) -> {at_most, ?MAX_P99};
rule(_, rate) -> {at_least, ?MIN_THROUGHPUT};
rule(_, mbs) -> {at_least, ?MIN_THROUGHPUT};
rule(_, _) -> none.

baseline_row(Base, Point, Summary) ->
    case [R || R = #{variant := V, point := P} <- Summary, V =:= Base, P =:= Point] of
        [Row | _] -> Row;
        [] -> none
    end.

cell(Name, #{variant := V, point := P, status := Status} = Row, BaseRow, Base,
     {F, Label, Rule}) ->
    Cell = #{scenario => Name, point => P, variant => V, figure => Label, key => F,
             limit => limit_text(Rule)},
    case {Status, maps:get(ratios, Row, #{})} of
        {ok, #{F := #{median := R}}} ->
            Within = within(R, Rule),
            Cell#{ratio => float(R), within => Within,
                  why => case Within of
                             true -> <<>>;
                             false -> <<"worse than tolerance">>
                         end};
        {ok, _} ->
            Cell#{ratio => null, within => false, why => no_ratio(Base, BaseRow)};
        {error, _} ->
            Cell#{ratio => null, within => false,
                  why => iolist_to_binary(["FAILED: ", note(Row)])};
        {Other, _} ->
            Cell#{ratio => null, within => false,
                  why => iolist_to_binary(io_lib:format("not measured (~s): ~s",
                                                        [Other, note(Row)]))}
    end.

within(R, {at_least, Min}) -> R >= Min;
within(R, {at_most, Max}) -> R =< Max.

no_ratio(Base, none) ->
    iolist_to_binary(["no ratio: no ", Base, " row for this point"]);
no_ratio(Base, #{status := ok}) ->
    iolist_to_binary(["no ratio: no repeat where both convoy and ", Base, " measured it"]);
no_ratio(Base, #{status := error} = Row) ->
    iolist_to_binary(["no ratio: ", Base, " FAILED (", note(Row), ")"]);
no_ratio(Base, #{status := S}) ->
    iolist_to_binary(io_lib:format("no ratio: ~s not measured (~s)", [Base, S])).

note(Row) ->
    case maps:get(note, Row, <<>>) of
        <<>> -> <<"no note">>;
        N -> N
    end.

limit_text({at_least, Min}) -> iolist_to_binary(io_lib:format(">= ~.2f", [Min]));
limit_text({at_most, Max}) -> iolist_to_binary(io_lib:format("<= ~.2f", [Max])).

%% @doc What is printed under the tables: the tolerances, the count line, then one
%% line per failing cell (scenario, point, variant, figure, ratio, limit, why).
-spec text(result()) -> iodata().
text(#{cells := M, within := N, failures := Failures}) ->
    #{throughput_min := T, p50_max := P50, p99_max := P99} = tolerances(),
    [io_lib:format("~n== check: every convoy cell vs the baseline of its scenario in this run "
                   "(plain; local for the same-node scenario), median of per-repeat ratios~n"
                   "tolerances: throughput (msg/s, rt/s, MB/s, deliveries/s, msg/min) >= ~.2fx, "
                   "p50 <= ~.2fx, p99 <= ~.2fx; a FAILED or unmeasured cell, or one without "
                   "a ratio, is outside~n", [T, P50, P99]),
     io_lib:format("convoy vs plain: ~b of ~b cells within tolerance~n", [N, M]),
     case Failures of
         [] ->
             [];
         _ ->
             Header = [<<"scenario">>, <<"point">>, <<"variant">>, <<"figure">>, <<"ratio">>,
                       <<"limit">>, <<"why">>],
             Rows = [[atom_to_binary(S), P, V, F, ratio_text(R), L, W]
                     || #{scenario := S, point := P, variant := V, figure := F, ratio := R,
                          limit := L, why := W} <- Failures],
             rows([Header | Rows])
     end].

ratio_text(null) -> <<"-">>;
ratio_text(R) -> io_lib:format("~.3f", [R]).

rows(Rows) ->
    Cells = [[iolist_to_binary(C) || C <- R] || R <- Rows],
    Widths = [lists:max([string:length(lists:nth(I, R)) || R <- Cells])
              || I <- lists:seq(1, length(hd(Cells)))],
    [["  ", lists:join("  ", pad(R, Widths)), "\n"] || R <- Cells].

pad([C], _) -> [C];
pad([C | Cs], [W | Ws]) -> [string:pad(C, W) | pad(Cs, Ws)].

-ifdef(TEST).
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
    check([scenario([base_row(), row(<<"convoy">>, Ratios)])], [<<"convoy">>]).

failing(Result) ->
    lists:sort([{K, R} || #{key := K, ratio := R} <- maps:get(failures, Result)]).

ok_ratios() -> #{rt_s => 1.0, p50_us => 1.0, p99_us => 1.0, p999_us => 9.0}.

all_within_test() ->
    R = check_one(ok_ratios()),
    ?assertMatch(#{cells := 3, within := 3, failures := []}, R),
    ?assertNotEqual(nomatch, string:find(iolist_to_binary(text(R)),
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
    R = check([S], [<<"convoy">>]),
    ?assertMatch(#{cells := 1, within := 0}, R),
    ?assertEqual([{mb_s, 0.5}], failing(R)).

failed_cell_test() ->
    Failed = #{variant => <<"convoy">>, point => <<"1 pairs, req">>, status => error,
               note => <<"deadline 20000 ms">>, ratios => #{}},
    R = check([scenario([base_row(), Failed])], [<<"convoy">>]),
    ?assertMatch(#{cells := 3, within := 0}, R),
    [?assertMatch(#{ratio := null, why := <<"FAILED: deadline 20000 ms">>}, C)
     || C <- maps:get(failures, R)],
    Text = iolist_to_binary(text(R)),
    ?assertNotEqual(nomatch, string:find(Text, "convoy vs plain: 0 of 3 cells within tolerance")),
    ?assertNotEqual(nomatch, string:find(Text, "FAILED: deadline 20000 ms")).

no_ratio_test() ->
    BaseFailed = (base_row())#{status => error, note => <<"boom">>},
    R = check([scenario([BaseFailed, row(<<"convoy">>, #{})])], [<<"convoy">>]),
    ?assertMatch(#{cells := 3, within := 0}, R),
    [?assertMatch(#{ratio := null, why := <<"no ratio: plain FAILED (boom)">>}, C)
     || C <- maps:get(failures, R)],
    Unmeasured = (row(<<"convoy">>, #{}))#{status => unavailable, note => <<"why">>},
    R2 = check([scenario([base_row(), Unmeasured])], [<<"convoy">>]),
    [?assertMatch(#{why := <<"not measured (unavailable): why">>}, C)
     || C <- maps:get(failures, R2)].

count_line_test() ->
    %% Two convoy variants, one point each: 6 cells, 2 failing.
    Rows = [base_row(), row(<<"convoy">>, ok_ratios()),
            row(<<"convoy[lanes=2]">>, (ok_ratios())#{rt_s => 0.5, p99_us => 2.0}),
            row(<<"delay_send">>, #{rt_s => 0.1})],
    R = check([scenario(Rows)], [<<"convoy">>, <<"convoy[lanes=2]">>]),
    ?assertMatch(#{cells := 6, within := 4}, R),
    Text = iolist_to_binary(text(R)),
    ?assertNotEqual(nomatch, string:find(Text, "convoy vs plain: 4 of 6 cells within tolerance\n")),
    ?assertNotEqual(nomatch, string:find(Text, "tolerances: throughput")),
    %% One line per failing cell, after the count line: the header and two rows.
    [_, After] = string:split(Text, "within tolerance\n"),
    ?assertEqual(3, length(string:lexemes(After, "\n"))),
    ?assertNotEqual(nomatch, string:find(After, "convoy[lanes=2]")),
    ?assertEqual(nomatch, string:find(After, "delay_send")),
    ?assertEqual(#{cells => 0, within => 0, failures => [], baseline => <<"plain">>,
                   tolerances => tolerances()},
                 check([scenario(Rows)], [])).
-endif.
