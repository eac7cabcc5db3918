%% Runs a scenario's variants interleaved and repeated, and summarises them.
%%
%% Repeat r measures every point once per variant, point by point: at each point
%% the variants run one after the other, in an order rotated by r and the point's
%% place (so no variant is always first after a pause or always last before one).
%% The runs a per-repeat ratio compares are thus seconds apart, not a whole
%% scenario apart: a slow spell of the machine or of a connection (large one-way
%% streams fall into one, by `!' too) lands on both sides of the ratio instead of
%% on one variant's repeat. A run that fails is recorded with its reason and the
%% others carry on. The summary gives, per variant and point, the median with min
%% and max of each figure, and for the compared figures the ratio to the baseline
%% variant taken repeat by repeat, then the median of those ratios.
%%
%% Every point has a deadline (the spec's `deadline', ms). The measurement runs in
%% a process of its own on the driver node; at the deadline that process is killed,
%% the point is recorded as FAILED with note `deadline N ms', and the variant's
%% nodes are reset (`convoy_bench_nodes:reset/2': new peers, or on given nodes
%% every measuring process killed and convoy restarted), so the next point,
%% variant or repeat measures on clean nodes.
-module(convoy_bench_runner).

-export([variants_for/2, baseline/1, run/4, summarise/3, primary/3,
         deadline_note/1]).

%% A wait for quiet nodes at least this long is reported in the progress lines.
-define(SETTLE_REPORT_MS, 200).

-type variant() :: #{name := binary(),
                     kind := local | local_call | plain | plain_again | ceiling
                             | handover | guarded | send_many | batch | nodelay_false
                             | delay_send | pg2 | manifold | convoy,
                     family := convoy_bench_nodes:family(),
                     mode := convoy_bench_measure:mode(),
                     convoy := convoy_bench_nodes:convoy_setting()}.
-type status() :: ok | error | awaiting | unavailable.
-type run() :: #{scenario := atom(), variant := binary(), repeat := pos_integer(),
                 point := binary(), status := status(), note := binary(),
                 figures := convoy_bench_measure:figures(), seconds := float()}.
-type opts() :: #{repeat := pos_integer(), progress := boolean(), t0 := integer()}.
-export_type([variant/0, run/0, opts/0]).

%% @doc The variants that make sense for a scenario: all of them across nodes
%% (`ceiling', `handover', `send_many', `batch' and `manifold' only where the
%% scenario has them, `local_call' nowhere); on one node (`local' scenario)
%% `local', `local_call' and the convoy ones. `pg2' (Phoenix.PubSub's own
%% adapter), `handover' and the convoy ones only, and `pg2' nowhere else, in a
%% scenario of Phoenix.PubSub (`pubsub').
-spec variants_for(convoy_bench_scenarios:spec(), [variant()]) -> [variant()].
variants_for(#{placement := same_node}, Variants) ->
    [V || V = #{kind := K} <- Variants, on_one_node(K) orelse K =:= convoy];
variants_for(#{pubsub := true}, Variants) ->
    [V || V = #{kind := K} <- Variants, K =:= pg2 orelse K =:= convoy orelse K =:= handover];
variants_for(#{placement := cross, ceiling := Ceiling, handover := Handover} = Spec,
             Variants) ->
    SendMany = maps:get(send_many, Spec, false),
    Batch = maps:get(batch, Spec, false),
    Manifold = maps:get(manifold, Spec, false),
    [V || V = #{kind := K} <- Variants, K =/= local_call, K =/= ceiling orelse Ceiling,
          (K =/= handover andalso K =/= guarded) orelse Handover,
          K =/= send_many orelse SendMany, K =/= batch orelse Batch,
          K =/= manifold orelse Manifold, K =/= pg2].

%% Variants that run everything on one node, whatever the scenario.
on_one_node(Kind) -> Kind =:= local orelse Kind =:= local_call.

%% @doc The variant the others are compared with.
-spec baseline(convoy_bench_scenarios:spec()) -> binary().
baseline(#{placement := same_node}) -> <<"local">>;
baseline(#{pubsub := true}) -> <<"pg2">>;
baseline(#{placement := cross}) -> <<"plain">>.

%% @doc All runs of `Spec' for `Variants', `repeat' times, interleaved point by
%% point.
-spec run(convoy_bench_scenarios:spec(), [variant()], opts(), convoy_bench_nodes:state()) ->
          {[run()], convoy_bench_nodes:state()}.
run(Spec = #{name := Name, points := Points}, Variants, Opts = #{repeat := Repeat}, Nodes0) ->
    unbuilt(Spec, Variants, Opts),
    Indexed = lists:zip(lists:seq(0, length(Points) - 1), Points),
    lists:foldl(
      fun(R, {Acc, N0}) ->
              progress(Opts, "~s  repeat ~b/~b ...", [Name, R, Repeat]),
              {Runs, N1} = lists:foldl(
                             fun({I, P}, {A1, NA}) ->
                                     Order = rotate(Variants, (R - 1 + I)
                                                    rem max(1, length(Variants))),
                                     {Rs, NB} = run_at_point(Spec, Order, R, P, Opts, NA),
                                     {A1 ++ Rs, NB}
                             end, {[], N0}, Indexed),
              {Acc ++ Runs, N1}
      end, {[], Nodes0}, lists:seq(1, Repeat)).

%% Variants whose Elixir beams are not built say so once (the whole scenario
%% when none of its variants can run); their runs are reported unavailable with
%% the same note (skip_reason/3).
unbuilt(#{name := Name} = Spec, Variants, Opts) ->
    Missing = [{Why, V} || #{name := V} = Variant <- Variants,
                           Why <- [unbuilt_why(Spec, Variant)], Why =/= none],
    [case [V || {W, V} <- Missing, W =:= Why] of
         Vs when length(Vs) =:= length(Variants) ->
             progress(Opts, "~s  skipped: ~s", [Name, Why]);
         Vs ->
             progress(Opts, "~s  ~s skipped: ~s", [Name, lists:join(", ", Vs), Why])
     end || Why <- lists:usort([W || {W, _} <- Missing])],
    ok.

%% What a variant needs built apart (Elixir) and is not, as a sentence saying how
%% to build it; `none' when it has it or needs nothing: Phoenix.PubSub and its
%% convoy adapter for every variant of a scenario of Phoenix.PubSub (`make
%% phoenix-build'), manifold for the `manifold' variant (`make manifold-build').
unbuilt_why(#{pubsub := true}, _Variant) ->
    missing(convoy_bench_pubsub:code_paths());
unbuilt_why(_Spec, #{kind := manifold}) ->
    missing(convoy_bench_fanout:manifold_paths());
unbuilt_why(_Spec, _Variant) ->
    none.

missing({ok, _Dirs}) -> none;
missing({error, Why}) -> Why.

rotate(L, 0) -> L;
rotate([H | T], N) -> rotate(T ++ [H], N - 1).

%% Every variant once at point `P'. Each is placed afresh: placing is a no-op
%% when its nodes already run its settings, and otherwise (re)starts or stops
%% convoy on them.
run_at_point(Spec = #{name := Name}, Order, R, P, Opts, Nodes0) ->
    lists:foldl(
      fun(V = #{name := VName}, {Acc, NA}) ->
              case skip_reason(Spec, V, NA) of
                  {Status, Note} ->
                      {Acc ++ [run_record(Name, VName, R, P, Status, Note, #{}, 0.0)], NA};
                  none ->
                      {Run, NB} = run_point(Spec, V, R, P, Opts, NA),
                      {Acc ++ [Run], NB}
              end
      end, {[], Nodes0}, Order).

%% One point of one variant, on nodes placed for it (a failure to place them
%% fails the point).
run_point(Spec = #{name := Name}, V = #{name := VName, family := F}, R, P, Opts, Nodes0) ->
    case point_skip(V, P) of
        none ->
            case placed(Spec, V, Nodes0, Opts) of
                {failed, Note} ->
                    {run_record(Name, VName, R, P, error, Note, #{}, 0.0), Nodes0};
                {Driver, Ctx, Nodes1} ->
                    settle(Spec, Nodes1, Opts),
                    case measure_point(Spec, V, R, P, Driver, Ctx, Opts) of
                        {deadline, Run} -> {Run, convoy_bench_nodes:reset(F, Nodes1)};
                        {done, Run} -> {Run, Nodes1}
                    end
            end;
        Why ->
            {run_record(Name, VName, R, P, unavailable, Why, #{}, 0.0), Nodes0}
    end.

%% Every point starts on quiet nodes (convoy_bench_nodes:settle/1); a long wait
%% is reported, as it says the previous point left work behind.
settle(#{name := Name}, Nodes, Opts) ->
    case convoy_bench_nodes:settle(Nodes) of
        Ms when Ms >= ?SETTLE_REPORT_MS -> progress(Opts, "~s  settled in ~b ms", [Name, Ms]);
        _ -> ok
    end.

placed(Spec = #{name := Name}, V = #{name := VName}, Nodes0, Opts) ->
    try
        place(Spec, V, Nodes0)
    catch
        Class:Reason:Stack ->
            Note = describe_error(Class, Reason, Stack),
            progress(Opts, "~s  ~s: could not prepare nodes: ~s", [Name, VName, Note]),
            {failed, Note}
    end.

skip_reason(#{convoy := {awaiting, Why}}, #{kind := convoy}, _Nodes) ->
    {awaiting, Why};
skip_reason(Spec = #{sinks := K}, Variant = #{family := F}, Nodes) ->
    case unbuilt_why(Spec, Variant) of
        none -> available(F, K, Nodes);
        Why -> {unavailable, Why}
    end.

available(F, K, Nodes) ->
    case convoy_bench_nodes:available(F, 1 + K, Nodes) of
        true -> none;
        {false, Why} -> {unavailable, Why}
    end.

%% A point that asks for two nodes (`where => cross', as in `flow') means nothing
%% for the `local' variant, which runs everything on one node.
point_skip(#{kind := local}, #{params := #{where := cross}}) ->
    <<"the local variant runs on one node: its figures are the same-node points">>;
point_skip(_V, _Point) ->
    none.

%% The driver node and the sink nodes of a variant.
place(#{placement := Placement, sinks := K}, #{kind := Kind, family := F, mode := M,
                                              convoy := C}, Nodes0) ->
    {[A | Rest], Nodes1} = convoy_bench_nodes:prepare(F, 1 + K, C, Nodes0),
    Sinks = case on_one_node(Kind) orelse Placement =:= same_node of
                true -> lists:duplicate(K, A);
                false -> lists:sublist(Rest, K)
            end,
    {A, #{mode => M, sinks => Sinks}, Nodes1}.

%% Measure one point in a process on the driver node, killed if it has not
%% answered by the deadline. Returns `{deadline, Run}' then (the caller resets the
%% nodes), `{done, Run}' otherwise.
measure_point(#{name := Name, timeout := Timeout, deadline := DeadlineMs}, #{name := VName},
              R, #{label := Label, params := Params}, Driver, Ctx, Opts) ->
    T0 = erlang:monotonic_time(),
    Result = measure_until(Driver, Name, Params, Ctx#{timeout => Timeout}, DeadlineMs),
    Secs = erlang:convert_time_unit(erlang:monotonic_time() - T0, native, millisecond) / 1000,
    case Result of
        {ok, Figures} ->
            progress(Opts, "~s  repeat ~b  ~s  ~s: ~s (~.1f s)",
                     [Name, R, VName, Label, brief(Figures), Secs]),
            {done, run_record(Name, VName, R, #{label => Label}, ok, <<>>, Figures, Secs)};
        {error, Note} ->
            progress(Opts, "~s  repeat ~b  ~s  ~s: FAILED ~s", [Name, R, VName, Label, Note]),
            {done, run_record(Name, VName, R, #{label => Label}, error, Note, #{}, Secs)};
        deadline ->
            Note = deadline_note(DeadlineMs),
            progress(Opts, "~s  repeat ~b  ~s  ~s: FAILED ~s (killed; the variant's nodes "
                     "are reset)", [Name, R, VName, Label, Note]),
            {deadline, run_record(Name, VName, R, #{label => Label}, error, Note, #{}, Secs)}
    end.

%% @doc The note of a point abandoned at its deadline.
-spec deadline_note(pos_integer()) -> binary().
deadline_note(Ms) ->
    iolist_to_binary(io_lib:format("deadline ~b ms", [Ms])).

measure_until(Driver, Name, Params, Ctx, DeadlineMs) ->
    Ref = make_ref(),
    {Pid, Mon} = spawn_monitor(Driver, convoy_bench_measure, run_for,
                               [self(), Ref, Name, {Params, Ctx}]),
    receive
        {Ref, {ok, Figures}} ->
            demonitor(Mon, [flush]),
            {ok, Figures};
        {Ref, {error, Class, Reason}} ->
            demonitor(Mon, [flush]),
            {error, case Class of
                        error -> short(Reason);
                        _ -> short({Class, Reason})
                    end};
        {'DOWN', Mon, process, Pid, Why} ->
            {error, short({measurement_died, Why})}
    after DeadlineMs ->
            exit(Pid, kill),
            receive {'DOWN', Mon, process, Pid, _} -> ok after 10000 -> ok end,
            %% An answer sent just before the kill is no use any more.
            receive {Ref, _} -> ok after 0 -> ok end,
            deadline
    end.

run_record(Scenario, Variant, R, #{label := Label}, Status, Note, Figures, Secs) ->
    #{scenario => Scenario, variant => Variant, repeat => R, point => Label,
      status => Status, note => Note, figures => Figures, seconds => Secs}.

brief(Figures) ->
    lists:join(", ", [io_lib:format("~s ~s", [K, convoy_bench_report:number(V)])
                      || {K, V} <- lists:sort(maps:to_list(Figures))]).

describe_error(error, {exception, Reason, _RemoteStack}, _Stack) ->
    short(Reason);
describe_error(error, {erpc, Reason}, _Stack) ->
    short({erpc, Reason});
describe_error(exit, {exception, Reason}, _Stack) ->
    short(Reason);
describe_error(Class, Reason, _Stack) ->
    short({Class, Reason}).

short(Term) ->
    iolist_to_binary(string:slice(io_lib:format("~0p", [Term]), 0, 300)).

progress(#{progress := false}, _F, _A) ->
    ok;
progress(#{t0 := T0}, F, A) ->
    Elapsed = erlang:convert_time_unit(erlang:monotonic_time() - T0, native, millisecond),
    io:format(standard_error, "[~7.1f s] " ++ F ++ "~n", [Elapsed / 1000 | A]).

%% @doc Per point and variant (in the given order): status, figures' spread, the
%% compared figures' ratios to the baseline and, for the convoy variants (and
%% `send_many' and `batch'), to the
%% limits that ran beside them in the same repeat: the `ceiling' variant
%% (`ceiling_ratios', where the scenario has one), the `handover' variant
%% (`handover_ratios', where the scenario has it), the `guarded' variant
%% (`guarded_ratios', where the handover runs; not for `guarded' itself) and the
%% best flag
%% (`flag_ratios': per repeat, the better of `nodelay_false' and `delay_send',
%% whichever of them measured that repeat; the higher rate, the lower time).
%% `beside_ratios': the same ratios to the other ways of sending a kind of variant
%% is compared with (`beside/1'), by variant name, those that ran at the point.
%% Empty maps where there is nothing to compare.
-spec summarise(convoy_bench_scenarios:spec(), [variant()], [run()]) -> [map()].
summarise(Spec = #{points := Points, figures := Figs, ratio := RatioFigs}, Variants, Runs) ->
    Base = baseline(Spec),
    [begin
         Mine = [Run || Run = #{variant := VN, point := PL} <- Runs, VN =:= VName, PL =:= Label],
         Ok = [Run || Run = #{status := ok} <- Mine],
         Limit = fun(Ran, Of) ->
                         case lists:member(Kind, [convoy, send_many, batch, guarded])
                             andalso Ran of
                             true -> ratios(RatioFigs, Ok, Of);
                             false -> #{}
                         end
                 end,
         Of = fun(Other) -> fun(F) -> by_repeat(F, ok_runs(Runs, Other, Label)) end end,
         #{variant => VName, point => Label,
           ceiling_ratios => Limit(maps:get(ceiling, Spec, false), Of(<<"ceiling">>)),
           handover_ratios => Limit(maps:get(handover, Spec, false), Of(<<"handover">>)),
           guarded_ratios => Limit(maps:get(handover, Spec, false) andalso Kind =/= guarded,
                                   Of(<<"guarded">>)),
           flag_ratios => Limit(true, fun(F) -> best_flag(F, Figs, Runs, Label) end),
           beside_ratios => maps:from_list(
                              [{Other, Rs} || Other <- beside(Kind), Other =/= VName,
                                              Rs <- [ratios(RatioFigs, Ok, Of(Other))],
                                              Rs =/= #{}]),
           status => summary_status(Mine, Ok),
           note => case Mine of [#{note := N} | _] when Ok =:= [] -> N; _ -> <<>> end,
           figures => maps:from_list(
                        [{F, S} || {F, _, _} <- Figs,
                                   S <- [convoy_bench_stats:spread(values(F, Ok))],
                                   S =/= none]),
           ratios => case VName =:= Base of
                         true -> #{};
                         false -> ratios(RatioFigs, Ok, Of(Base))
                     end}
     end || #{label := Label} <- Points, #{name := VName, kind := Kind} <- Variants].

%% The variants a kind of variant is also compared with, where they ran beside it:
%% `batch' (`convoy:batch/1' around the convoy variants' sends) with `convoy'
%% (the same sends, no scope) and with `send_many' (the sender's own lists); the
%% convoy variants with `manifold' (in `fanout': `Manifold.send/2' where convoy
%% multicasts) and those with settings of their own (`--convoy') with `convoy'
%% (the defaults).
beside(batch) -> [<<"convoy">>, <<"send_many">>];
beside(convoy) -> [<<"manifold">>, <<"convoy">>];
beside(_) -> [].

%% The distribution flags' variants, whose best per repeat convoy is compared with.
-define(FLAGS, [<<"nodelay_false">>, <<"delay_send">>]).

%% `[{Repeat, Value}]' of figure `F' at point `Label': per repeat, the best of the
%% flags' variants that measured it (the highest rate, the lowest time).
best_flag(F, Figs, Runs, Label) ->
    {F, _, Unit} = lists:keyfind(F, 1, Figs),
    Best = case lists:member(Unit, [us, ms, ns]) of
               true -> fun lists:min/1;
               false -> fun lists:max/1
           end,
    Values = lists:append([by_repeat(F, ok_runs(Runs, V, Label)) || V <- ?FLAGS]),
    [{R, Best([V || {R2, V} <- Values, R2 =:= R])}
     || R <- lists:usort([R || {R, _} <- Values])].

ok_runs(Runs, VName, Label) ->
    [Run || Run = #{variant := VN, point := PL, status := ok} <- Runs, VN =:= VName,
            PL =:= Label].

%% Per compared figure, the spread of the per-repeat ratios of `Runs' to
%% `BaseOf(F)' (`[{Repeat, Value}]'); figures with no repeat on both sides are
%% left out.
ratios(RatioFigs, Runs, BaseOf) ->
    maps:from_list([{F, S} || F <- RatioFigs,
                              S <- [convoy_bench_stats:ratios(by_repeat(F, Runs), BaseOf(F))],
                              S =/= none]).

summary_status([], _) -> unavailable;
summary_status(_, [_ | _]) -> ok;
summary_status([#{status := S} | _], []) -> S.

values(F, Runs) -> [V || #{figures := #{F := V}} <- Runs].

by_repeat(F, Runs) -> [{R, V} || #{repeat := R, figures := #{F := V}} <- Runs].

%% @doc The figure `tune' optimises, per repeat, for one variant: the primary
%% figure, as the geometric mean over the scenario's points (a repeat with a failed
%% point is left out). Returns `[{Repeat, Value}]'.
-spec primary(convoy_bench_scenarios:spec(), binary(), [run()]) -> [{pos_integer(), float()}].
primary(#{primary := {F, _}, points := Points}, VName, Runs) ->
    Mine = [Run || Run = #{variant := VN, status := ok} <- Runs, VN =:= VName],
    Repeats = lists:usort([R || #{repeat := R} <- Mine]),
    [{R, convoy_bench_stats:geomean(Vs)}
     || R <- Repeats,
        Vs <- [[V || #{repeat := R2, figures := #{F := V}} <- Mine, R2 =:= R, V > 0]],
        length(Vs) =:= length(Points)].
