%% `--check''s second look (`--confirm N'). On a shared 2-core machine a cell can
%% fall outside tolerance because one repeat met a busy scheduler: the same cell
%% moves by 20-50% between runs. Each scenario with cells outside tolerance is run
%% again, at those points only, for its baseline and the convoy variants concerned:
%% N more repeats, interleaved as the first ones were. The new runs join the first
%% (numbered after them), and the scenario is summarised and checked again over all
%% its repeats: a cell is never judged on the new repeats alone, and one that was
%% slower every time stays outside. Cells that failed outright (FAILED, not
%% measured, no ratio) are not run again. The scenario's result records what was
%% re-measured (`confirmed'), and the table says so.
-module(convoy_bench_confirm).

-export([confirm/5, targets/1, renumber/2]).

-type target() :: #{points := [binary()], variants := [binary()]}.
-export_type([target/0]).

%% @doc Run again, `Extra' more repeats, every scenario with cells of the convoy
%% variants outside tolerance; returns the scenarios with their runs joined and
%% summarised again.
-spec confirm(pos_integer(), [convoy_bench_runner:variant()], convoy_bench_runner:opts(),
              [map()], convoy_bench_nodes:state()) -> {[map()], convoy_bench_nodes:state()}.
confirm(Extra, Variants, RunOpts, Scenarios, Nodes0) ->
    %% plain_again (--noise) gets the same second look as convoy: the run's noise is
    %% judged as convoy is.
    Judged = [N || #{name := N, kind := K} <- Variants, K =:= convoy orelse K =:= plain_again],
    #{failures := Failures} = convoy_bench_check:check(Scenarios, Judged),
    Targets = targets(Failures),
    lists:mapfoldl(fun(S = #{name := Name}, N0) ->
                           case Targets of
                               #{Name := T} -> again(S, T, Extra, Variants, RunOpts, N0);
                               _ -> {S, N0}
                           end
                   end, Nodes0, Scenarios).

%% @doc Per scenario, the points and convoy variants of the cells worth measuring
%% again: outside tolerance with a ratio (a FAILED or unmeasured cell is not noise).
-spec targets([map()]) -> #{atom() => target()}.
targets(Failures) ->
    lists:foldl(fun(#{scenario := S, point := P, variant := V}, Acc) ->
                        #{points := Ps, variants := Vs} =
                            maps:get(S, Acc, #{points => [], variants => []}),
                        Acc#{S => #{points => lists:usort([P | Ps]),
                                    variants => lists:usort([V | Vs])}}
                end, #{}, [F || F = #{ratio := R} <- Failures, R =/= null]).

%% @doc `New' runs numbered after the `Old' ones: a repeat keeps pairing a variant
%% with the baseline measured beside it.
-spec renumber([convoy_bench_runner:run()], [convoy_bench_runner:run()]) ->
          [convoy_bench_runner:run()].
renumber(New, Old) ->
    Last = lists:max([0 | [R || #{repeat := R} <- Old]]),
    [Run#{repeat := R + Last} || Run = #{repeat := R} <- New].

again(S = #{spec := Spec = #{points := Points}, runs := Runs, baseline := Base,
            seconds := Secs},
      T = #{points := Labels, variants := Again}, Extra, Variants, RunOpts, Nodes0) ->
    Only = Spec#{points := [P || P = #{label := L} <- Points, lists:member(L, Labels)]},
    Measured = [V || V = #{name := N} <- Variants, N =:= Base orelse lists:member(N, Again)],
    case RunOpts of
        #{progress := true} ->
            io:format(standard_error, "--confirm: ~s again at ~s, ~b more repeats~n",
                      [maps:get(name, S), lists:join(", ", Labels), Extra]);
        _ ->
            ok
    end,
    T0 = erlang:monotonic_time(),
    {New, Nodes} = convoy_bench_runner:run(Only, Measured, RunOpts#{repeat := Extra}, Nodes0),
    Dt = erlang:convert_time_unit(erlang:monotonic_time() - T0, native, millisecond) / 1000,
    All = Runs ++ renumber(New, Runs),
    Own = convoy_bench_runner:variants_for(Spec, Variants),
    {S#{runs := All, seconds := Secs + Dt,
        summary := convoy_bench_runner:summarise(Spec, Own, All),
        confirmed => T#{repeats => Extra}},
     Nodes}.
