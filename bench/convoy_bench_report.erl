%% Everything the harness writes: the seed-style table (stdout and table.txt),
%% results.csv (one row per scenario, variant, repeat and point, with every figure
%% and the settings), results.json (the whole result) and gnuplot plots.
-module(convoy_bench_report).

-export([table/1, config_text/1, write/2, number/1, value/2, csv_columns/1]).


%%--------------------------------------------------------------------
%% Table

%% @doc The printed report: configuration, one table per scenario, then the tune
%% report and the `--check' summary when there are.
-spec table(map()) -> iodata().
table(Result = #{config := C, scenarios := Scenarios}) ->
    [config_text(C), [["\n", scenario_table(S)] || S <- Scenarios],
     case Result of
         #{tune := Tune} -> ["\n", convoy_bench_tune:text(Tune)];
         _ -> []
     end,
     case Result of
         #{check := Check} -> convoy_bench_check:text(Check);
         _ -> []
     end].

%% @doc The configuration lines printed above the tables.
-spec config_text(map()) -> iodata().
config_text(C) ->
    #{facts := F, started := Started, repeat := Repeat, size := Size,
      variants := Vs, nodes := NodesNote} = C,
    Defaults = maps:get(convoy_defaults, F),
    [io_lib:format("convoy bench ~s on ~s~n", [Started, maps:get(host, F)]),
     io_lib:format("OTP ~s (erts ~s); schedulers ~b (~b online); logical processors ~s~n",
                   [maps:get(otp_release, F), maps:get(erts_version, F),
                    maps:get(schedulers, F), maps:get(schedulers_online, F),
                    cores(F)]),
     host_text(F),
     io_lib:format("nodes: ~s~n", [NodesNote]),
     io_lib:format("convoy defaults: ~s~n", [settings_text(Defaults)]),
     "variants:\n", [["  ", variant_text(V), "\n"] || V <- Vs],
     io_lib:format("sizes ~s, ~b repeat~s interleaved; cells: median [min - max]; "
                   "\"x base\": median over repeats of variant/base in the same repeat "
                   "(\"x best flag\": base = the better of nodelay_false and delay_send)~n",
                   [Size, Repeat, case Repeat of 1 -> ""; _ -> "s" end])].

%% The host's CPU model, memory and OS, where the node could read them.
host_text(F) ->
    Parts = [[K, " ", V] || {K, V} <- [{"cpu", maps:get(cpu_model, F, null)},
                                      {"memory", gib(maps:get(memory_gib, F, null))},
                                      {"os", maps:get(os, F, null)}],
                           V =/= null],
    case Parts of
        [] -> [];
        _ -> [lists:join("; ", Parts), "\n"]
    end.

gib(null) -> null;
gib(G) -> [number(G), " GiB"].

cores(F) ->
    case maps:get(logical_processors_available, F) of
        null -> io_lib:format("~b", [maps:get(logical_processors, F)]);
        A -> io_lib:format("~b (~b available)", [maps:get(logical_processors, F), A])
    end.

variant_text(V = #{name := N}) ->
    [N, " = ", variant_what(V)].

variant_what(#{kind := convoy, settings := S}) ->
    ["convoy:send/2 with ", settings_text(S)];
variant_what(#{kind := Kind, flags := Flags}) ->
    case {lists:keyfind(Kind, 1, variant_texts()), Flags} of
        {{Kind, Text}, _} -> Text;
        {false, []} -> "`!` between two nodes";
        {false, _} -> ["`!` between two nodes started with ", lists:join(" ", Flags)]
    end.

%% What each kind of variant other than convoy's and the flags' sends with.
variant_texts() ->
    [{local, "`!` on one node"},
     {local_call, "`!` on one node behind one call to another module's function "
      "(convoy_bench_call:send/2), in the local scenario: what calling any library's send "
      "costs"},
     {plain_again, "plain again (`!` between two nodes), interleaved with the others: the "
      "run's noise"},
     {ceiling, "a batching router with no bookkeeping (convoy_bench_ceiling), where a scenario "
      "has one"},
     {handover, "each message handed to one bare batching process per node, which ships lists "
      "of up to 1000 when its mailbox drains (convoy_bench_handover), in oneway, oneway8, "
      "flood, cast and mesh"},
     {guarded, "the handover with only the sender's per-message work convoy's promises need "
      "(settings, size, marker, an exact bound of messages and bytes), where handover runs"},
     {send_many, "convoy with the sender handing its messages over in lists of 1000 "
      "(convoy:send_many/1), in oneway and oneway8"},
     {batch, "convoy with its sends inside convoy:batch/1: a stream's in scopes of 1000 "
      "sends, every other send in a scope of its own, in oneway, oneway8, pairs and latency; "
      "also given as a fraction of convoy and send_many"},
     {manifold, "discord/manifold's Manifold.send/2 (built by make manifold-build), in "
      "fanout, where convoy variants use convoy:multicast/2 and are also given as a fraction "
      "of it"},
     {pg2, "Phoenix.PubSub's own adapter, Phoenix.PubSub.PG2 (`!`), in pubsub, where convoy "
      "variants use Phoenix.PubSub.Convoy"}].

settings_text(S) ->
    lists:join(" ", [io_lib:format("~s=~p", [K, V]) || {K, V} <- lists:sort(maps:to_list(S))]).

scenario_table(Result = #{name := Name, title := Title, spec := Spec, summary := Summary,
                          baseline := Base, seconds := Secs}) ->
    #{figures := Figs, ratio := RatioFigs, points := Points} = Spec,
    MultiPoint = length(Points) > 1,
    Limits = limits(Result),
    Header = [<<"point">> || MultiPoint] ++ [<<"variant">>]
        ++ [Label || {_, Label, _} <- Figs]
        ++ [iolist_to_binary(["x ", Base, " ", label_of(F, Figs)]) || F <- RatioFigs]
        ++ [iolist_to_binary(["x ", LimitLabel, " ", label_of(F, Figs)])
            || {_, LimitLabel} <- Limits, F <- RatioFigs],
    Rows = [row(S, MultiPoint, Figs, RatioFigs, Limits) || S <- Summary],
    [io_lib:format("== ~s: ~s (~.1f s)~n", [Name, Title, Secs]),
     format_rows([Header | Rows]),
     notes(Summary),
     confirmed(Result)].

%% The columns that give a row as a fraction of another variant measured beside
%% it (the summary's keys to the ratios and the column's label). Where the
%% scenario has a convoy variant (or `send_many', `batch', `guarded') and the
%% limit ran: the best distribution flag (`nodelay_false', `delay_send'), the
%% `handover', `guarded' and `ceiling' variants. Then every variant some row is
%% compared with in `beside_ratios' (`batch''s with `convoy' and `send_many',
%% convoy's with `manifold').
limits(#{spec := Spec, variants := Vs, summary := Summary}) ->
    Ran = fun(V) -> lists:member(V, Vs) end,
    Limits = case lists:any(fun(<<"convoy", _/binary>>) -> true; (<<"send_many">>) -> true;
                               (<<"batch">>) -> true; (<<"guarded">>) -> true;
                               (_) -> false end, Vs) of
                 false ->
                     [];
                 true ->
                     [{[flag_ratios], <<"best flag">>}
                      || Ran(<<"nodelay_false">>) orelse Ran(<<"delay_send">>)]
                         ++ [{[handover_ratios], <<"handover">>}
                             || maps:get(handover, Spec, false), Ran(<<"handover">>)]
                         ++ [{[guarded_ratios], <<"guarded">>}
                             || maps:get(handover, Spec, false), Ran(<<"guarded">>)]
                         ++ [{[ceiling_ratios], <<"ceiling">>}
                             || maps:get(ceiling, Spec, false), Ran(<<"ceiling">>)]
             end,
    Beside = lists:uniq([V || #{beside_ratios := B} <- Summary, V <- lists:sort(maps:keys(B))]),
    Limits ++ [{[beside_ratios, V], V} || V <- Beside].

%% --confirm: which rows have more repeats than the header says, and why.
confirmed(#{confirmed := #{points := Ps, variants := Vs, repeats := N}, baseline := Base}) ->
    io_lib:format("  re-measured (--confirm ~b: outside tolerance at first): ~s, for ~s; "
                  "their cells are over every repeat~n",
                  [N, lists:join(", ", Ps), lists:join(", ", [Base | Vs])]);
confirmed(_) ->
    [].

label_of(F, Figs) ->
    {F, L, _} = lists:keyfind(F, 1, Figs),
    L.

row(#{variant := V, point := P, status := ok, figures := FS, ratios := RS} = S,
    MultiPoint, Figs, RatioFigs, Limits) ->
    [P || MultiPoint] ++ [V]
        ++ [case FS of
                #{F := Spread} -> spread_text(Spread, Unit);
                _ -> <<"-">>
            end || {F, _, Unit} <- Figs]
        ++ ratio_cells(RS, RatioFigs)
        ++ lists:append([ratio_cells(ratios_at(Keys, S), RatioFigs) || {Keys, _} <- Limits]);
row(#{variant := V, point := P, status := Status}, MultiPoint, _Figs, _RatioFigs, _) ->
    [P || MultiPoint] ++ [V, status_text(Status)].

%% The ratios under `Keys' in a summary row (none: `#{}').
ratios_at([], Ratios) -> Ratios;
ratios_at([K | Ks], Row) -> ratios_at(Ks, maps:get(K, Row, #{})).

ratio_cells(Ratios, Figs) ->
    [case Ratios of
         #{F := #{median := R}} -> io_lib:format("~.2f", [R]);
         _ -> <<"-">>
     end || F <- Figs].

status_text(awaiting) -> <<"awaits flow control (issue 4): not measured">>;
status_text(unavailable) -> <<"not available here (see note)">>;
status_text(error) -> <<"FAILED (see note)">>.

notes(Summary) ->
    Notes = lists:usort([{S, N} || #{status := S, note := N} <- Summary, S =/= ok, N =/= <<>>]),
    [io_lib:format("  note (~s): ~s~n", [S, N]) || {S, N} <- Notes].

spread_text(#{median := M, min := Min, max := Max, n := 1}, Unit) when M == Min, M == Max ->
    value(M, Unit);
spread_text(#{median := M, min := Min, max := Max}, Unit) ->
    [value(M, Unit), " [", value(Min, Unit), " - ", value(Max, Unit), "]"].

%% @doc A figure's value in `Unit', three significant digits with its unit.
-spec value(number(), convoy_bench_scenarios:unit()) -> iolist().
value(V, rate) -> number(V);
value(V, mbs) -> number(V);
value(V, number) -> number(V);
value(V, count) -> integer_to_list(round(V));
value(V, bytes) when V >= 1.0e4 -> [number(V), "B"];
value(V, bytes) -> [number(V), " B"];
value(V, ms) -> [number(V), " ms"];
value(V, ns) when V >= 10000 -> [number(V / 1000), " us"];
value(V, ns) -> [number(V), " ns"];
value(V, us) when V >= 10000 -> [number(V / 1000), " ms"];
value(V, us) -> [number(V), " us"].

%% @doc A number with three significant digits and an SI suffix (k, M, G).
-spec number(number()) -> iolist().
number(V) when V >= 1.0e9 -> [sig(V / 1.0e9), " G"];
number(V) when V >= 1.0e6 -> [sig(V / 1.0e6), " M"];
number(V) when V >= 1.0e4 -> [sig(V / 1.0e3), " k"];
number(V) -> sig(V).

sig(V) when V >= 100 -> integer_to_list(round(V));
sig(V) when V >= 10 -> io_lib:format("~.1f", [float(V)]);
sig(V) -> io_lib:format("~.2f", [float(V)]).

format_rows(Rows) ->
    Cells = [[iolist_to_binary(C) || C <- R] || R <- Rows],
    Width = lists:foldl(fun(R, W) -> widen(R, W) end, [], Cells),
    [[["  ", lists:join("  ", pad(R, Width)), "\n"]] || R <- Cells].

widen([], W) -> W;
widen([C | Cs], []) -> [string:length(C) | widen(Cs, [])];
widen([C | Cs], [W | Ws]) -> [max(W, string:length(C)) | widen(Cs, Ws)].

pad([C], _) -> [C];
pad([C | Cs], [W | Ws]) -> [string:pad(C, W) | pad(Cs, Ws)].

%%--------------------------------------------------------------------
%% Files

%% @doc Write table.txt, results.csv, results.json and the plots into `Dir';
%% returns the files written and notes (e.g. plots that could not be made).
-spec write(file:filename(), map()) -> {[file:filename()], [binary()]}.
write(Dir, Result) ->
    ok = filelib:ensure_dir(filename:join(Dir, "x")),
    Table = filename:join(Dir, "table.txt"),
    ok = file:write_file(Table, table(Result)),
    Csv = filename:join(Dir, "results.csv"),
    ok = file:write_file(Csv, csv(Result)),
    Json = filename:join(Dir, "results.json"),
    ok = file:write_file(Json, convoy_bench_json:encode(json_safe(Result))),
    {Plots, Notes} = case maps:get(plots, maps:get(config, Result), true) of
                         true -> convoy_bench_plot:plots(Dir, Result);
                         false -> {[], [<<"plots disabled (--no-plots)">>]}
                     end,
    {[Table, Csv, Json | Plots], Notes}.

%% Specs carry tuples (figure definitions): make them JSON objects.
json_safe(#{scenarios := Ss} = R) ->
    R#{scenarios := [S#{spec := spec_json(Spec)} || S = #{spec := Spec} <- Ss]}.

spec_json(Spec = #{figures := Figs, primary := {PF, Dir}, convoy := C}) ->
    Spec#{figures := [#{key => K, label => L, unit => U} || {K, L, U} <- Figs],
          primary := #{figure => PF, better => Dir},
          convoy := case C of
                        measured -> measured;
                        {awaiting, Why} -> #{awaiting => Why}
                    end}.

%% @doc The CSV header of a result: the run's identity, every figure any scenario
%% reports, then every convoy setting (empty for variants without convoy).
-spec csv_columns(map()) -> [atom()].
csv_columns(#{config := #{variants := Vs}}) ->
    [scenario, variant, kind, family, dist_flags, repeat, point, status, note, seconds]
        ++ figure_columns()
        ++ lists:usort([K || #{settings := S} <- Vs, K <- maps:keys(S)]).

figure_columns() ->
    lists:usort([F || N <- convoy_bench_scenarios:names(),
                      {F, _, _} <- maps:get(figures, convoy_bench_scenarios:spec(N, tiny, #{}))]).

csv(Result = #{scenarios := Scenarios, config := #{variants := Vs}}) ->
    Cols = csv_columns(Result),
    Rows = [csv_row(Run, lists:keyfind(maps:get(variant, Run), 1,
                                       [{maps:get(name, V), V} || V <- Vs]))
            || #{runs := Runs} <- Scenarios, Run <- Runs],
    [lists:join(",", [atom_to_list(C) || C <- Cols]), "\n",
     [[lists:join(",", [csv_cell(maps:get(C, R, <<>>)) || C <- Cols]), "\n"] || R <- Rows]].

csv_row(Run = #{figures := Figs}, {_, V}) ->
    Settings = case V of
                   #{kind := convoy, settings := S} -> S;
                   _ -> #{}
               end,
    maps:merge(maps:merge(maps:remove(figures, Run), Figs),
               Settings#{kind => maps:get(kind, V), family => maps:get(family, V),
                         dist_flags => iolist_to_binary(lists:join(" ", maps:get(flags, V)))}).

csv_cell(V) when is_float(V) -> float_to_list(V, [short]);
csv_cell(V) when is_integer(V) -> integer_to_list(V);
csv_cell(V) when is_atom(V) -> atom_to_list(V);
csv_cell(V0) when is_binary(V0) ->
    V = binary:replace(V0, [<<"\n">>, <<"\r">>], <<" ">>, [global]),
    case binary:match(V, [<<",">>, <<"\"">>]) of
        nomatch -> V;
        _ -> [$", binary:replace(V, <<"\"">>, <<"\"\"">>, [global]), $"]
    end.
