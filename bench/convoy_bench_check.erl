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

-export([check/2, check/3, tolerances/0, text/1]).

-define(MIN_THROUGHPUT, 0.95).
-define(MAX_P50, 1.10).
-define(MAX_P99, 1.25).

-type rule() :: {at_least | at_most, float()}.
-type cell() :: #{scenario := atom(), point := binary(), variant := binary(),
                  figure := binary(), key := atom(), ratio := float() | null,
                  limit := binary(), within := boolean(), why := binary(),
                  noise => float() | null}.
%% `noise': the same check of `plain_again' (`--noise'), when it is in the run;
%% then each failing convoy cell also carries `noise', the ratio of `plain_again'
%% at the same point and figure (null when it has none).
-type result() :: #{baseline := binary(), tolerances := map(),
                    cells := non_neg_integer(), within := non_neg_integer(),
                    failures := [cell()], noise => result()}.
-export_type([result/0]).

%% @doc The tolerances, as printed and written to results.json.
-spec tolerances() -> #{throughput_min := float(), p50_max := float(), p99_max := float()}.
tolerances() ->
    #{throughput_min => ?MIN_THROUGHPUT, p50_max => ?MAX_P50, p99_max => ?MAX_P99}.

%% @doc Check every cell of the variants named `Convoy' in `Scenarios' (scenario
%% results: `name', `spec' (its `figures' and `ratio'), `baseline', `summary').
%% The same check of `plain_again' (`!' against itself) measures the run's noise.
-spec check([map()], [binary()]) -> result().
check(Scenarios, Convoy) ->
    summary(cells(Scenarios, Convoy)).

%% @doc `check/2' of `Convoy', with the run's noise: the same check of `Again'
%% (`plain_again', `!' against itself) as `noise', and beside each failing convoy
%% cell the ratio `!' measured against itself there, so a reader sees whether the
%% cell is outside by more than the run's own spread at that very cell.
-spec check([map()], [binary()], [binary()]) -> result().
check(Scenarios, Convoy, Again) ->
    Noise = cells(Scenarios, Again),
    At = maps:from_list([{{S, P, K}, R} || #{scenario := S, point := P, key := K, ratio := R}
                                            <- Noise]),
    Result = #{failures := Failures} = check(Scenarios, Convoy),
    Result#{failures := [C#{noise => maps:get({S, P, K}, At, null)}
                         || C = #{scenario := S, point := P, key := K} <- Failures],
            noise => summary(Noise)}.

cells(Scenarios, Variants) ->
    lists:append([scenario_cells(S, Variants) || S <- Scenarios]).

summary(Cells) ->
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
%% line per failing cell (scenario, point, variant, figure, ratio, limit, with the
%% run's noise `!' against itself at that cell, why); the same for `plain_again'
%% when the run has it.
-spec text(result()) -> iodata().
text(Result = #{cells := M, within := N, failures := Failures}) ->
    #{throughput_min := T, p50_max := P50, p99_max := P99} = tolerances(),
    [io_lib:format("~n== check: every convoy cell vs the baseline of its scenario in this run "
                   "(plain; local for the same-node scenario), median of per-repeat ratios~n"
                   "tolerances: throughput (msg/s, rt/s, MB/s, deliveries/s, msg/min) >= ~.2fx, "
                   "p50 <= ~.2fx, p99 <= ~.2fx; a FAILED or unmeasured cell, or one without "
                   "a ratio, is outside~n", [T, P50, P99]),
     io_lib:format("convoy vs plain: ~b of ~b cells within tolerance~n", [N, M]),
     failure_rows(Failures),
     case Result of
         #{noise := #{cells := NM, within := NN, failures := NF}} ->
             [io_lib:format("plain_again vs plain (`!` run again beside itself: the run's "
                            "noise, same tolerances): ~b of ~b cells within tolerance~n",
                            [NN, NM]),
              failure_rows(NF)];
         _ ->
             []
     end].

failure_rows([]) ->
    [];
failure_rows(Failures) ->
    %% With the run's noise, each row also shows `!' against itself at that cell.
    Noise = lists:any(fun(C) -> is_map_key(noise, C) end, Failures),
    Header = [<<"scenario">>, <<"point">>, <<"variant">>, <<"figure">>, <<"ratio">>,
              <<"limit">>] ++ [<<"! again">> || Noise] ++ [<<"why">>],
    Rows = [[atom_to_binary(S), P, V, F, ratio_text(R), L]
            ++ [ratio_text(maps:get(noise, C, null)) || Noise] ++ [W]
            || C = #{scenario := S, point := P, variant := V, figure := F, ratio := R,
                     limit := L, why := W} <- Failures],
    rows([Header | Rows]).

ratio_text(null) -> <<"-">>;
ratio_text(R) -> io_lib:format("~.3f", [R]).

rows(Rows) ->
    Cells = [[iolist_to_binary(C) || C <- R] || R <- Rows],
    Widths = [lists:max([string:length(lists:nth(I, R)) || R <- Cells])
              || I <- lists:seq(1, length(hd(Cells)))],
    [["  ", lists:join("  ", pad(R, Widths)), "\n"] || R <- Cells].

pad([C], _) -> [C];
pad([C | Cs], [W | Ws]) -> [string:pad(C, W) | pad(Cs, Ws)].
