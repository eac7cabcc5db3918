%% `tune SCENARIO': which convoy settings win on this machine for one scenario.
%%
%% A coordinate sweep: starting from the defaults, each knob in turn (lanes,
%% max_batch, max_delay, large_threshold) is tried at each of its values with the
%% best values found so far for the others; every candidate of a step runs
%% interleaved and repeated like any variant, and the one with the best median of
%% the scenario's primary figure (geometric mean over its points) is kept, if it
%% beats the current value by more than 3% (noise otherwise picks knobs). Then the
%% winner is measured once more against the baseline (plain, or local for the
%% same-node scenario) and the defaults, and the gains are the medians of the
%% per-repeat ratios. The result names the settings and gives the sys.config
%% snippet.
-module(convoy_bench_tune).

-export([tune/4, grid/0, text/1]).

%% A change must beat the value it replaces by this factor (medians) to be kept.
-define(MIN_GAIN, 1.03).

%% @doc The values tried for each knob, in sweep order.
-spec grid() -> [{atom(), [term()]}].
grid() ->
    [{lanes, [1, 2, 4]},
     {max_batch, [100, 1000, 10000]},
     {max_delay, [0, 100, 1000]},
     {large_threshold, [16384, 65536, 1048576, infinity]}].

%% @doc Sweep, then compare the best with `Base' and the defaults. Returns the tune
%% report, the final comparison (variants, runs, seconds) and the node state.
-spec tune(convoy_bench_scenarios:spec(), convoy_bench_runner:variant(),
           convoy_bench_runner:opts(), convoy_bench_nodes:state()) ->
          {map(), {[convoy_bench_runner:variant()], [convoy_bench_runner:run()], float()},
           convoy_bench_nodes:state()}.
tune(Spec = #{primary := {_, Better}}, Base, Opts, Nodes0) ->
    {ok, Defaults} = convoy_config:validate(#{}),
    {Best, Steps, SweepRuns, Nodes1} =
        lists:foldl(fun({Key, Values}, {Cur, StepsAcc, RunsAcc, N0}) ->
                            {Step, Runs, Chosen, N1} = step(Spec, Key, Values, Cur, Opts, N0),
                            {Chosen, StepsAcc ++ [Step], RunsAcc ++ Runs, N1}
                    end, {#{}, [], [], Nodes0}, grid()),
    Given = maps:filter(fun(K, V) -> maps:get(K, Defaults) =/= V end, Best),
    DefaultsV = convoy_bench:convoy_variant(<<"convoy">>, #{}),
    Final = case map_size(Given) of
                0 -> [Base, DefaultsV];
                _ -> [Base, DefaultsV, convoy_bench:convoy_variant(name(Given), Given)]
            end,
    T0 = erlang:monotonic_time(),
    {Runs, Nodes2} = convoy_bench_runner:run(Spec, Final, Opts, Nodes1),
    Secs = erlang:convert_time_unit(erlang:monotonic_time() - T0, native, millisecond) / 1000,
    BestName = maps:get(name, lists:last(Final)),
    Prim = fun(V) -> convoy_bench_runner:primary(Spec, V, Runs) end,
    Tune = #{scenario => maps:get(name, Spec),
             primary => element(1, maps:get(primary, Spec)), better => Better,
             steps => Steps,
             best => maps:merge(Defaults, Given), changed => Given, best_variant => BestName,
             gain_over_base => gain(Better, Prim(BestName), Prim(maps:get(name, Base))),
             base => maps:get(name, Base),
             gain_over_defaults => gain(Better, Prim(BestName), Prim(<<"convoy">>)),
             sys_config => sys_config(Given),
             sweep_runs => SweepRuns},
    {Tune, {Final, Runs, Secs}, Nodes2}.

step(Spec = #{primary := {_, Better}}, Key, Values, Cur, Opts, Nodes0) ->
    Cands = [{V, Cur#{Key => V}} || V <- Values],
    Variants = [convoy_bench:convoy_variant(name(S), S) || {_, S} <- Cands],
    {Runs, Nodes1} = convoy_bench_runner:run(Spec, Variants, Opts, Nodes0),
    Scored = [{V, S, median(convoy_bench_runner:primary(Spec, name(S), Runs))}
              || {V, S} <- Cands],
    Measured = [X || X = {_, _, M} <- Scored, M =/= none],
    CurValue = maps:get(Key, Cur, maps:get(Key, element(2, convoy_config:validate(#{})))),
    Chosen = case lists:sort(fun({_, _, A}, {_, _, B}) -> better(Better, A, B) end,
                             Measured) of
                 [] -> Cur;
                 [{_, S, M} | _] ->
                     %% Keep the current value unless the winner clearly beats it:
                     %% on a noisy machine a knob that does nothing wins half the
                     %% time.
                     case [CM || {V, _, CM} <- Measured, V =:= CurValue] of
                         [CM] -> case clearly_better(Better, M, CM) of
                                     true -> S;
                                     false -> Cur#{Key => CurValue}
                                 end;
                         [] -> S
                     end
             end,
    Step = #{knob => Key,
             tried => [#{value => V, median => M} || {V, _, M} <- Scored],
             chosen => maps:get(Key, Chosen, maps:get(Key, Cur, default))},
    {Step, Runs, Chosen, Nodes1}.

better(higher, A, B) -> A >= B;
better(lower, A, B) -> A =< B.

clearly_better(higher, New, Cur) -> New > Cur * ?MIN_GAIN;
clearly_better(lower, New, Cur) -> New * ?MIN_GAIN < Cur.

median([]) -> none;
median(L) -> convoy_bench_stats:median([V || {_, V} <- L]).

gain(Better, Best, Base) ->
    Ratios = case Better of
                 higher -> convoy_bench_stats:ratios(Best, Base);
                 lower -> convoy_bench_stats:ratios(Base, Best)
             end,
    case Ratios of
        none -> null;
        R -> R
    end.

name(S) when map_size(S) =:= 0 ->
    <<"convoy">>;
name(S) ->
    iolist_to_binary(["convoy[", lists:join(",", [io_lib:format("~s=~p", [K, V])
                                                 || {K, V} <- lists:sort(maps:to_list(S))]),
                      "]"]).

sys_config(Given) ->
    iolist_to_binary(io_lib:format("[{convoy, ~p}].", [lists:sort(maps:to_list(Given))])).

%% @doc The tune part of the printed report.
-spec text(map()) -> iodata().
text(#{scenario := Scenario, primary := Prim, better := Better, steps := Steps,
       best := Best, changed := Changed, base := Base, gain_over_base := GB,
       gain_over_defaults := GD, sys_config := Snippet}) ->
    [io_lib:format("== tune ~s: ~s, ~s is better; one knob at a time, best so far kept~n",
                   [Scenario, Prim, Better]),
     [io_lib:format("  ~-16s ~s  -> ~p~n",
                    [K, lists:join("  ", [io_lib:format("~p: ~s", [V, med(M)])
                                          || #{value := V, median := M} <- Tried]), C])
      || #{knob := K, tried := Tried, chosen := C} <- Steps],
     io_lib:format("  best: ~s~n", [lists:join(" ", [io_lib:format("~s=~p", [K, V])
                                                     || {K, V} <- lists:sort(maps:to_list(Best))])]),
     case map_size(Changed) of
         0 -> "  the defaults won: nothing to change\n";
         _ -> ""
     end,
     io_lib:format("  gain over ~s: ~s; over convoy defaults: ~s "
                   "(median [min - max] of per-repeat ratios, >1 = better)~n",
                   [Base, gain_text(GB), gain_text(GD)]),
     io_lib:format("  sys.config: ~s~n", [Snippet])].

med(none) -> "failed";
med(M) -> convoy_bench_report:number(M).

gain_text(null) -> "not measured";
gain_text(#{median := M, min := Min, max := Max}) ->
    io_lib:format("~.2fx [~.2f - ~.2f]", [M, float(Min), float(Max)]).
