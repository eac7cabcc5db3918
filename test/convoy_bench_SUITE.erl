%% The benchmark harness (bench/) in tiny mode, through the same entry point the
%% command line uses (`convoy_bench:main/1'): every scenario runs, and what it
%% writes is well formed. No assertion on any measured figure's value: the machine
%% is shared and noisy; only the shape of the results is checked.
-module(convoy_bench_SUITE).

-include_lib("common_test/include/ct.hrl").
-include_lib("stdlib/include/assert.hrl").

-export([all/0, suite/0, init_per_suite/1, end_per_suite/1]).
-export([every_scenario_tiny/1, noise_tiny/1, guarded_tiny/1, batch_tiny/1, manifold_tiny/1,
         tune_tiny/1, cost_tiny/1,
         bar_charts/1, bars_tiny/1, given_nodes/1,
         arguments/1, deadline/1, deadline_leaves_clean_peers/1,
         deadline_leaves_clean_given_nodes/1, settle/1, drain_before_stop/1,
         guarded_waits_for_room/1]).

suite() ->
    [{timetrap, {minutes, 6}}].

all() ->
    [arguments, bar_charts, every_scenario_tiny, noise_tiny, guarded_tiny, batch_tiny,
     manifold_tiny, tune_tiny, cost_tiny,
     bars_tiny, given_nodes,
     deadline, deadline_leaves_clean_peers, deadline_leaves_clean_given_nodes, settle,
     drain_before_stop, guarded_waits_for_room].

init_per_suite(Config) ->
    Config.

end_per_suite(_Config) ->
    ok.

%%--------------------------------------------------------------------

arguments(_Config) ->
    {ok, #{help := Help}} = convoy_bench:main(["--help"]),
    [?assertNotEqual(nomatch, binary:match(Help, list_to_binary(Opt)), Opt)
     || Opt <- ["--scenario", "--full", "--quick", "--tiny", "--repeat", "--convoy",
                "--variants", "--param", "--tune", "tune SCENARIO", "--nodes", "--cookie",
                "--netns", "--rate", "--peer-args", "--out", "--no-plots", "--quiet",
                "--check", "--confirm", "--noise", "plain_again", "deadline_ms", "--help",
                "batch (oneway, oneway8, pairs, latency", "manifold (fanout only",
                "from 100 senders each to its own 100"]],
    [?assertMatch({error, <<_/binary>>}, convoy_bench:main(Args), Args)
     || Args <- [["--bogus"], ["--scenario", "nope"], ["--repeat", "0"],
                 ["--convoy", "lane=2"], ["--convoy", "lanes=0"], ["--convoy", "lanes"],
                 ["--variants", "nope"], ["--param", "nope=1"],
                 ["--nodes", "a@h"], ["--netns"], ["--confirm", "-1"], ["--confirm"]]],
    {ok, #{convoy := [{<<"max_batch=5000,lanes=2">>, #{max_batch := 5000, lanes := 2}}]}} =
        convoy_bench:parse(["--convoy", "max_batch=5000,lanes=2"]),
    %% a zlib level is an integer setting, `never' an atom one
    {ok, #{convoy := [{<<"compress=6">>, #{compress := 6}},
                      {<<"compress=never">>, #{compress := never}}]}} =
        convoy_bench:parse(["--convoy", "compress=6", "--convoy", "compress=never"]),
    ?assertMatch({error, <<_/binary>>}, convoy_bench:main(["--convoy", "compress=10"])),
    {ok, #{check := true, params := #{deadline_ms := 5}}} =
        convoy_bench:parse(["--check", "--param", "deadline_ms=5"]),
    {ok, #{confirm := 3}} = convoy_bench:parse(["--check"]),
    {ok, #{confirm := 0}} = convoy_bench:parse(["--check", "--confirm", "0"]),
    {ok, #{command := page, page := "r1", also := ["r2", "r3"], charts := "c"}} =
        convoy_bench:parse(["page", "r1", "--also", "r2", "--charts", "c", "--also", "r3"]),
    %% plain_again runs only when asked for: by --noise or by name
    Names = fun(Args) ->
                    {ok, O} = convoy_bench:parse(Args),
                    [N || #{name := N} <- convoy_bench:variants(O)]
            end,
    ?assertNot(lists:member(<<"plain_again">>, Names([]))),
    ?assertMatch([<<"local">>, <<"local_call">>, <<"plain">>, <<"plain_again">> | _],
                 Names(["--noise"])),
    ?assertEqual([<<"plain">>, <<"plain_again">>, <<"convoy">>],
                 Names(["--variants", "plain,convoy", "--noise"])),
    ?assertEqual([<<"plain">>, <<"plain_again">>], Names(["--variants", "plain_again,plain"])),
    %% so does guarded, by name
    ?assertNot(lists:member(<<"guarded">>, Names(["--noise"]))),
    ?assertEqual([<<"handover">>, <<"guarded">>], Names(["--variants", "guarded,handover"])),
    %% a variant with several settings is named as printed, its commas included
    ?assertEqual([<<"plain">>, <<"convoy[lanes=2,max_batch=500]">>],
                 Names(["--convoy", "lanes=2,max_batch=500",
                        "--variants", "plain,convoy[lanes=2,max_batch=500]"])),
    ?assertEqual(0, convoy_bench:exit_status({ok, #{}})),
    ?assertEqual(0, convoy_bench:exit_status({ok, #{check => #{within => 3, cells => 3}}})),
    ?assertEqual(1, convoy_bench:exit_status({ok, #{check => #{within => 2, cells => 3}}})),
    ?assertEqual(2, convoy_bench:exit_status({error, <<"bad">>})),
    ok.

every_scenario_tiny(Config) ->
    Dir = filename:join(?config(priv_dir, Config), "all"),
    Built = #{pubsub => phoenix_build(), manifold => manifold_build()},
    {ok, R} = convoy_bench:main(["--tiny", "--full", "--repeat", "2", "--quiet", "--check",
                                 "--convoy", "max_batch=50", "--out", Dir]),
    Names = convoy_bench_scenarios:names(),
    #{scenarios := Scenarios, config := #{facts := Facts}} = R,
    ?assertEqual(Names, [N || #{name := N} <- Scenarios]),
    ?assertMatch(#{otp_release := <<_/binary>>, schedulers_online := _,
                   logical_processors := _, convoy_defaults := #{lanes := _}}, Facts),
    [check_scenario(S, Built) || S <- Scenarios],
    %% manifold (Manifold.send/2) runs in fanout only, convoy's rows there given
    %% against it when it was measured
    [?assertEqual(N =:= fanout, lists:member(<<"manifold">>, Vs), N)
     || #{name := N, variants := Vs} <- Scenarios],
    %% mesh: every node of each point sent (per node = in all / nodes), every
    %% message arrived (the measurement exits otherwise)
    [?assert(abs(PerNode * N - All) < 1.0e-6 * All, {L, V})
     || #{name := mesh, spec := #{points := Points}, runs := Runs} <- Scenarios,
        #{label := L, params := #{nodes := N}} <- Points,
        #{point := L1, variant := V, status := ok,
          figures := #{msg_s := All, node_msg_s := PerNode}} <- Runs, L1 =:= L],
    %% hol measures the receiving node's page faults wherever /proc tells them.
    [?assert(is_number(maps:get(sink_faults_mb, Fs, none)), Run)
     || filelib:is_regular("/proc/self/stat"),
        #{name := hol, runs := Runs} <- Scenarios,
        Run = #{status := ok, figures := Fs = #{bulk_mb_s := MBs}} <- Runs, MBs > 0],
    %% pairs' paced point: each client waits 0 to 2 x pace_ms (pace_ms on
    %% average, and a timer never fires early) after every answer, so no variant
    %% does much more than pairs * 1000 / pace_ms round trips a second (half as
    %% many again allows for the draws of a 100 ms window; without the pace, 8
    %% pairs do about 100 k).
    [?assert(Rate =< 1.5 * Pairs * 1000 / Pace, {V, Rate})
     || #{name := pairs, spec := #{points := Points}, runs := Runs} <- Scenarios,
        #{label := L, params := #{pairs := Pairs, pace_ms := Pace}} <- Points, Pace > 0,
        #{point := L1, variant := V, status := ok, figures := #{rt_s := Rate}} <- Runs,
        L1 =:= L],
    ?assert(lists:any(fun(#{params := Ps}) -> maps:get(pace_ms, Ps) > 0 end,
                      hd([Ps || #{name := pairs, spec := #{points := Ps}} <- Scenarios]))),
    %% `local_call' (`!' behind one call) runs in the same-node scenario only.
    [?assertEqual(N =:= local, lists:member(<<"local_call">>, Vs), N)
     || #{name := N, variants := Vs} <- Scenarios],
    check_files(Dir, R),
    %% --check: every checked figure of both convoy variants at every point; no
    %% value asserted (the machine is noisy), only the accounting.
    #{check := #{cells := M, within := N, failures := Failures}} = R,
    Checked = fun(#{ratio := Ratio, figures := Figs}) ->
                      length([F || F <- Ratio, {F1, _, U} <- Figs, F1 =:= F,
                                   lists:member(U, [rate, mbs])
                                       orelse F =:= p50_us orelse F =:= p99_us])
              end,
    ?assertEqual(2 * lists:sum([length(P) * Checked(Spec)
                                || #{spec := Spec = #{points := P}} <- Scenarios]), M),
    ?assertEqual(M - N, length(Failures)),
    {ok, Table} = file:read_file(filename:join(Dir, "table.txt")),
    Line = io_lib:format("convoy vs plain: ~b of ~b cells within tolerance", [N, M]),
    ?assertNotEqual(nomatch, string:find(Table, Line)),
    %% convoy beside the limits: the best flag everywhere across nodes, the
    %% handover and the ceiling where they ran
    [?assertNotEqual(nomatch, string:find(Table, Column), Column)
     || Column <- ["x best flag msg/s", "x best flag rt/s", "x best flag p99",
                   "x handover msg/s", "x handover msg/min", "x ceiling msg/s",
                   "handover = each message handed to one bare batching process"]],
    {ok, Bin} = file:read_file(filename:join(Dir, "results.json")),
    {ok, #{<<"check">> := #{<<"cells">> := M, <<"within">> := N,
                            <<"tolerances">> := #{<<"p50_max">> := _}}}} =
        convoy_bench_json:decode(Bin),
    ok.

%% --noise with --check: plain_again's cells are judged as convoy's (the same
%% points and figures, against plain), printed and written beside them, and the
%% exit status stays convoy's.
noise_tiny(Config) ->
    Dir = filename:join(?config(priv_dir, Config), "noise"),
    {ok, R} = convoy_bench:main(["--tiny", "--scenario", "oneway,pairs", "--repeat", "2",
                                 "--quiet", "--no-plots", "--check", "--noise",
                                 "--variants", "plain,convoy", "--out", Dir]),
    %% plain_again measured every point that plain did
    [?assertEqual(lists:sort([P || #{variant := <<"plain">>, point := P, status := ok} <- Sum]),
                  lists:sort([P || #{variant := <<"plain_again">>, point := P, status := ok}
                                       <- Sum]))
     || #{summary := Sum} <- maps:get(scenarios, R)],
    #{check := #{cells := M, within := N,
                 noise := #{cells := NM, within := NN, failures := NF}}} = R,
    ?assertEqual(M, NM),
    ?assertEqual(NM - NN, length(NF)),
    [?assertEqual(<<"plain_again">>, V) || #{variant := V} <- NF],
    %% each failing convoy cell carries `!''s ratio against itself there (or null)
    [?assert(is_map_key(noise, F)) || F <- maps:get(failures, maps:get(check, R))],
    {ok, Table} = file:read_file(filename:join(Dir, "table.txt")),
    [?assertNotEqual(nomatch, string:find(Table, Line), Line)
     || Line <- [io_lib:format("convoy vs plain: ~b of ~b cells within tolerance", [N, M]),
                 io_lib:format("noise, same tolerances): ~b of ~b cells within tolerance",
                               [NN, NM]),
                 "plain_again = plain again"]],
    {ok, Bin} = file:read_file(filename:join(Dir, "results.json")),
    {ok, #{<<"check">> := #{<<"within">> := N,
                            <<"noise">> := #{<<"cells">> := NM, <<"within">> := NN}}}} =
        convoy_bench_json:decode(Bin),
    Check = maps:get(check, R),
    ?assertEqual(convoy_bench:exit_status({ok, R#{check := maps:remove(noise, Check)}}),
                 convoy_bench:exit_status({ok, R})),
    ok.

%% guarded (named) runs where the handover runs and nowhere else; its rows are
%% given as fractions of the handover and of the best flag, as convoy's are.
guarded_tiny(Config) ->
    Dir = filename:join(?config(priv_dir, Config), "guarded"),
    {ok, R} = convoy_bench:main(["--tiny", "--scenario", "oneway,flood,pairs", "--repeat", "1",
                                 "--quiet", "--no-plots", "--out", Dir, "--variants",
                                 "plain,nodelay_false,handover,guarded,convoy"]),
    Scenarios = maps:get(scenarios, R),
    [?assertEqual(Name =/= pairs, lists:member(<<"guarded">>, Vs), Name)
     || #{name := Name, variants := Vs} <- Scenarios],
    Rows = [{Name, S} || #{name := Name, summary := Sum} <- Scenarios,
                         S = #{variant := <<"guarded">>} <- Sum],
    %% oneway's atom, event and phoenix points, flood's ping and event
    ?assertEqual(5, length(Rows)),
    [begin
         ?assertMatch(#{status := ok}, S, Name),
         Ratios = lists:sort(maps:get(ratio, Spec)),
         ?assertEqual(Ratios, lists:sort(maps:keys(HR)), Name),
         ?assertEqual(Ratios, lists:sort(maps:keys(FR)), Name)
     end || {Name, S = #{handover_ratios := HR, flag_ratios := FR}} <- Rows,
            #{name := N1, spec := Spec} <- Scenarios, N1 =:= Name],
    {ok, Table} = file:read_file(filename:join(Dir, "table.txt")),
    ?assertNotEqual(nomatch, string:find(Table, "guarded = the handover with only")),
    check_files(Dir, R),
    ok.

%% batch (convoy's sends inside convoy:batch/1) is measured where the scenario
%% runs it, both ways of a round trip included; its rows are given against convoy
%% and, where send_many runs, against send_many, in the summary, the table and
%% results.json.
batch_tiny(Config) ->
    Dir = filename:join(?config(priv_dir, Config), "batch"),
    {ok, R} = convoy_bench:main(["--tiny", "--scenario", "oneway,pairs", "--repeat", "1",
                                 "--quiet", "--no-plots", "--out", Dir, "--variants",
                                 "plain,send_many,batch,convoy"]),
    [Oneway, Pairs] = maps:get(scenarios, R),
    [?assert(lists:member(<<"batch">>, Vs)) || #{variants := Vs} <- [Oneway, Pairs]],
    Rows = fun(#{summary := Sum}) -> [S || S = #{variant := <<"batch">>} <- Sum] end,
    ?assertEqual(3, length(Rows(Oneway))), % atom, event, phoenix
    ?assertEqual(4, length(Rows(Pairs))),
    [begin
         ?assertMatch(#{status := ok}, S, Name),
         Ratios = lists:sort(maps:get(ratio, Spec)),
         ?assertEqual(Ratios, lists:sort(maps:keys(maps:get(ratios, S))), Name),
         ?assertEqual(lists:sort(Others), lists:sort(maps:keys(Beside)), Name),
         [?assertEqual(Ratios, lists:sort(maps:keys(maps:get(O, Beside))), {Name, O})
          || O <- Others]
     end || {Scenario, Others} <- [{Oneway, [<<"convoy">>, <<"send_many">>]},
                                   {Pairs, [<<"convoy">>]}],
            #{name := Name, spec := Spec} <- [Scenario],
            S = #{beside_ratios := Beside} <- Rows(Scenario)],
    {ok, Table} = file:read_file(filename:join(Dir, "table.txt")),
    [?assertNotEqual(nomatch, string:find(Table, Column), Column)
     || Column <- ["x convoy msg/s", "x send_many msg/s", "x convoy rt/s", "x convoy p99",
                   "batch = convoy with its sends inside convoy:batch/1"]],
    {ok, Bin} = file:read_file(filename:join(Dir, "results.json")),
    {ok, #{<<"scenarios">> := [#{<<"summary">> := JsonRows} | _]}} = convoy_bench_json:decode(Bin),
    [?assertMatch(#{<<"convoy">> := #{<<"msg_s">> := #{<<"median">> := _}},
                    <<"send_many">> := #{<<"msg_s">> := #{<<"median">> := _}}}, B)
     || #{<<"variant">> := <<"batch">>, <<"beside_ratios">> := B} <- JsonRows],
    check_files(Dir, R),
    ok.

%% fanout with manifold (discord/manifold's Manifold.send/2), built first where
%% elixirc and its source are: measured at every point, the new one (senders each
%% to its own receivers) included, and convoy's rows given against it; where it
%% cannot be built, every manifold run says how to build it. A round of the
%% own-receivers point delivers `receivers' messages in all, the other
%% many-senders point `receivers' per sender.
manifold_tiny(Config) ->
    Dir = filename:join(?config(priv_dir, Config), "manifold"),
    Built = manifold_build(),
    {ok, R} = convoy_bench:main(["--tiny", "--scenario", "fanout", "--repeat", "1", "--quiet",
                                 "--no-plots", "--out", Dir, "--variants",
                                 "plain,convoy,manifold"]),
    [#{variants := Vs, runs := Runs, summary := Summary,
       spec := #{points := Points, params := #{receivers := Receivers}}}] =
        maps:get(scenarios, R),
    ?assertEqual([<<"plain">>, <<"manifold">>, <<"convoy">>], Vs),
    ?assertEqual([<<"200 procs">>, <<"200 procs, 10 senders">>,
                  <<"200 procs, 10 senders x own 20">>], [L || #{label := L} <- Points]),
    [?assertMatch(#{status := ok}, Run) || Run = #{variant := V} <- Runs, V =/= <<"manifold">>],
    Manifold = [Run || Run = #{variant := <<"manifold">>} <- Runs],
    ?assertEqual(3, length(Manifold)),
    {ok, Table} = file:read_file(filename:join(Dir, "table.txt")),
    case Built of
        true ->
            [?assertMatch(#{status := ok}, Run) || Run <- Manifold],
            [?assertEqual([deliveries_s], maps:keys(maps:get(<<"manifold">>, B)))
             || #{variant := <<"convoy">>, beside_ratios := B} <- Summary],
            ?assertNotEqual(nomatch, string:find(Table, "x manifold deliveries/s")),
            ?assertNotEqual(nomatch, string:find(Table, "manifold = discord/manifold's"));
        false ->
            [?assertMatch(#{status := unavailable,
                            note := <<"manifold is not built", _/binary>>}, Run)
             || Run <- Manifold],
            [?assertEqual(#{}, B) || #{beside_ratios := B} <- Summary]
    end,
    %% deliveries in a round, whatever the variant: deliveries/s x the median round
    Delivered = [{L, round(D * Ms / 1000)}
                 || #{point := L, status := ok,
                      figures := #{deliveries_s := D, round_ms := Ms}} <- Runs],
    Many = <<"200 procs, 10 senders">>,
    ?assertEqual([Receivers], lists:usort([N || {L, N} <- Delivered, L =/= Many])),
    ?assertEqual([10 * Receivers], lists:usort([N || {L, N} <- Delivered, L =:= Many])),
    check_files(Dir, R),
    ok.

%% A bar chart for each scenario with no other plot, from a result in the shape
%% `convoy_bench:main/1' makes (the scenarios' specs, `summarise/3' over
%% fabricated runs): flood and oneway drawn, with their `.dat' and `.gp'; cast,
%% where only plain ran, has no bar to draw and says so; no chart for a scenario
%% that did not run.
bar_charts(Config) ->
    case os:find_executable("gnuplot") of
        false ->
            {skip, "gnuplot not found (apt-get install gnuplot-nox): no chart to check"};
        _ ->
            Dir = filename:join(?config(priv_dir, Config), "bars"),
            ok = filelib:ensure_dir(filename:join(Dir, "x")),
            Scenario = fun convoy_bench_bars_tests:scenario/2,
            Result = #{scenarios =>
                           [Scenario(flood, [{<<"plain">>, [100, 200]},
                                             {<<"ceiling">>, [400, 300]},
                                             {<<"handover">>, [150, none]},
                                             {<<"convoy">>, [250, 100]}]),
                            Scenario(oneway, [{<<"plain">>, [100, 100, 100]},
                                              {<<"nodelay_false">>, [90, 110, 100]},
                                              {<<"guarded">>, [250, 150, 140]},
                                              {<<"convoy">>, [80, 120, 110]}]),
                            Scenario(cast, [{<<"plain">>, [100]}])]},
            {Pngs, Notes} = convoy_bench_plot:plots(Dir, Result),
            ?assertEqual(["flood_x_plain.png", "oneway_x_plain.png"],
                         lists:sort([filename:basename(P) || P <- Pngs])),
            [begin
                 {ok, <<137, "PNG", _/binary>>} = file:read_file(P),
                 [?assert(filelib:is_regular(filename:rootname(P) ++ Ext), Ext)
                  || Ext <- [".dat", ".gp"]]
             end || P <- Pngs],
            ?assertMatch([<<"no cast_x_plain.png: no variant has a ratio to plain", _/binary>>],
                         Notes),
            ?assertEqual(2, length(filelib:wildcard(filename:join(Dir, "*.png")))),
            ok
    end.

%% A tiny run of the default selection's headline scenarios, plots on: a bar
%% chart each, among the files the run reports, the handover hatched as a limit.
bars_tiny(Config) ->
    case os:find_executable("gnuplot") of
        false ->
            {skip, "gnuplot not found (apt-get install gnuplot-nox): no chart to check"};
        _ ->
            Dir = filename:join(?config(priv_dir, Config), "bars_tiny"),
            {ok, R} = convoy_bench:main(["--tiny", "--scenario", "flood,oneway", "--repeat", "1",
                                         "--quiet", "--variants", "plain,handover,convoy",
                                         "--out", Dir]),
            Files = [binary_to_list(filename:basename(F)) || F <- maps:get(files, R)],
            [begin
                 ?assert(lists:member(Png, Files), {Png, Files}),
                 {ok, <<137, "PNG", _/binary>>} = file:read_file(filename:join(Dir, Png)),
                 {ok, Gp} = file:read_file(filename:join(Dir, filename:rootname(Png) ++ ".gp")),
                 ?assertNotEqual(nomatch, binary:match(Gp, <<"fs pattern">>)),
                 ?assertNotEqual(nomatch, binary:match(Gp, <<"title 'handover (limit)'">>))
             end || Png <- ["flood_x_plain.png", "oneway_x_plain.png"]],
            check_files(Dir, R),
            ok
    end.

tune_tiny(Config) ->
    Dir = filename:join(?config(priv_dir, Config), "tune"),
    {ok, R} = convoy_bench:main(["tune", "oneway", "--tiny", "--repeat", "1", "--quiet",
                                 "--no-plots", "--out", Dir]),
    #{tune := T = #{best := Best, changed := Changed, sys_config := Snippet, steps := Steps}} = R,
    ?assertEqual([K || {K, _} <- convoy_bench_tune:grid()], [K || #{knob := K} <- Steps]),
    ?assertMatch({ok, _}, convoy_config:validate(Best)),
    {ok, Tokens, _} = erl_scan:string(binary_to_list(Snippet)),
    {ok, [{convoy, Env}]} = erl_parse:parse_term(Tokens),
    ?assertEqual(Changed, maps:from_list(Env)),
    ?assert(is_map(maps:get(gain_over_base, T)) orelse maps:get(gain_over_base, T) =:= null),
    [#{name := oneway}] = maps:get(scenarios, R),
    check_files(Dir, R),
    ok.

%% `cost': every step for each of the three shapes, a figure each, the exchange's rows (the
%% send call in 1 and in 4 request/response pairs, by convoy, by `!' behind one
%% call and by `!') among
%% them, and the table names every step.
cost_tiny(_Config) ->
    {ok, #{cost := Rows, text := Text}} = convoy_bench:main(["cost", "--tiny"]),
    Steps = lists:usort([S || #{step := S} <- Rows]),
    ?assertEqual(3 * length(Steps), length(Rows)),
    [?assert(is_float(Ns) andalso Ns >= 0) || #{ns := Ns} <- Rows],
    Exchange = [S || S = <<"[exchange]", _/binary>> <- Steps],
    ?assertEqual([<<"[exchange] send call, 1 pair: ! (plain)">>,
                  <<"[exchange] send call, 1 pair: ! behind one call">>,
                  <<"[exchange] send call, 1 pair: convoy:send/2">>,
                  <<"[exchange] send call, 4 pairs: ! (plain)">>,
                  <<"[exchange] send call, 4 pairs: ! behind one call">>,
                  <<"[exchange] send call, 4 pairs: convoy:send/2">>], Exchange),
    %% a phase measured calls: none is measured as zero
    [?assert(Ns > 0) || #{step := <<"[exchange]", _/binary>>, ns := Ns} <- Rows],
    [?assertNotEqual(nomatch, binary:match(Text, S)) || S <- Steps],
    %% the call to a local destination beside `!'
    ?assertEqual([<<"local destination: ! (plain)">>, <<"local destination: convoy:send/2">>],
                 [S || S = <<"local destination", _/binary>> <- Steps]),
    %% the guarded floor beside the whole send and its batcher beside the lane
    %% (CPU time in milliseconds: a tiny loop may read 0)
    ?assertEqual(6, length([R || R = #{step := <<"[cpu] guarded floor", _/binary>>} <- Rows])),
    %% a fresh process's first send, in the call and in CPU, for each way of sending
    Fresh = [S || S = <<"[fresh", _/binary>> <- Steps],
    ?assertEqual(8, length(Fresh)),
    [?assertEqual(2, length([S || S <- Fresh, binary:match(S, Mode) =/= nomatch]), Mode)
     || Mode <- [<<"convoy:send/2">>, <<"send_guarded/2">>, <<"hand-over">>, <<"! to the">>]],
    [?assert(Ns > 0) || #{step := <<"[fresh] ", _/binary>>, ns := Ns} <- Rows],
    %% a stream's CPU on each node, for convoy, the guarded floor and the bare
    %% hand-over (CPU time in milliseconds: a tiny stream may read 0)
    ?assertEqual([<<"[stream cpu] node ", N/binary, ", per message: ", M/binary>>
                  || N <- [<<"A">>, <<"B">>],
                     M <- [<<"bare hand-over">>, <<"convoy:send/2">>, <<"guarded floor">>]],
                 [S || S = <<"[stream cpu]", _/binary>> <- Steps]),
    ok.

%% Running nodes given with --nodes: the harness loads its own code there; the
%% variants that need node flags are reported unavailable, not run.
given_nodes(Config) ->
    Ebin = filename:dirname(code:which(convoy)),
    Peers = [begin
                 {ok, P, N} = ?CT_PEER(#{name => ?CT_PEER_NAME(Name),
                                         args => ["-pa", Ebin, "-connect_all", "false"]}),
                 {P, N}
             end || Name <- ["bench_given_a", "bench_given_b"]],
    Nodes = lists:join(",", [atom_to_list(N) || {_, N} <- Peers]),
    Dir = filename:join(?config(priv_dir, Config), "given"),
    try
        {ok, R} = convoy_bench:main(["--tiny", "--scenario", "oneway,fanout", "--repeat", "1",
                                     "--quiet", "--no-plots", "--nodes", lists:flatten(Nodes),
                                     "--out", Dir]),
        [Oneway, Fanout] = maps:get(scenarios, R),
        Status = fun(#{summary := Sum}, V) -> hd([S || #{variant := X, status := S} <- Sum,
                                                     X =:= V]) end,
        ?assertEqual(ok, Status(Oneway, <<"plain">>)),
        ?assertEqual(ok, Status(Oneway, <<"convoy">>)),
        ?assertEqual(unavailable, Status(Oneway, <<"nodelay_false">>)),
        ?assertEqual(unavailable, Status(Fanout, <<"plain">>)),
        check_files(Dir, R)
    after
        [peer:stop(P) || {P, _} <- Peers]
    end.

%% A flood of a million pingers cannot finish in 1.5 s: every flood point is
%% reported FAILED with the deadline as note, and the run carries on (oneway
%% measures on the replaced nodes) and completes.
deadline(Config) ->
    Dir = filename:join(?config(priv_dir, Config), "deadline"),
    {ok, R} = convoy_bench:main(["--tiny", "--scenario", "flood,oneway", "--repeat", "1",
                                 "--variants", "plain,convoy", "--param", "pingers=1000000",
                                 "--param", "deadline_ms=1500", "--quiet", "--no-plots",
                                 "--out", Dir]),
    [Flood, Oneway] = maps:get(scenarios, R),
    ?assertEqual(1500, maps:get(deadline, maps:get(spec, Flood))),
    FloodRuns = maps:get(runs, Flood),
    ?assertEqual(4, length(FloodRuns)),
    [?assertMatch(#{status := error, note := <<"deadline 1500 ms">>}, Run) || Run <- FloodRuns],
    [?assertMatch(#{status := error, note := <<"deadline 1500 ms">>}, S)
     || S <- maps:get(summary, Flood)],
    [?assertMatch(#{status := ok}, Run) || Run <- maps:get(runs, Oneway)],
    {ok, Table} = file:read_file(filename:join(Dir, "table.txt")),
    ?assertNotEqual(nomatch, binary:match(Table, <<"note (error): deadline 1500 ms">>)),
    check_files(Dir, R),
    ok.

%% After a point abandoned at its deadline, the next run measures on clean nodes:
%% a left-over pong would still hold the registered name the next flood needs.
deadline_leaves_clean_peers(_Config) ->
    Nodes0 = convoy_bench_nodes:new(#{given => none, peer_args => []}),
    Nodes = deadline_then_flood(Nodes0),
    ok = convoy_bench_nodes:stop(Nodes).

deadline_leaves_clean_given_nodes(_Config) ->
    Ebin = filename:dirname(code:which(convoy)),
    Peers = [begin
                 {ok, P, N} = ?CT_PEER(#{name => ?CT_PEER_NAME(Name),
                                         args => ["-pa", Ebin, "-connect_all", "false",
                                                  "+P", "2000000"]}),
                 {P, N}
             end || Name <- ["bench_clean_a", "bench_clean_b"]],
    Given = [N || {_, N} <- Peers],
    try
        Nodes0 = convoy_bench_nodes:new(#{given => Given, peer_args => []}),
        Nodes = deadline_then_flood(Nodes0),
        [?assertEqual(0, erpc:call(N, convoy_bench_nodes, kill_measurements, [])) || N <- Given],
        ok = convoy_bench_nodes:stop(Nodes)
    after
        [peer:stop(P) || {P, _} <- Peers]
    end.

%% Before a point, the harness waits while work is waiting to run: here, more
%% busy processes than schedulers for 300 ms.
settle(_Config) ->
    State = convoy_bench_nodes:new(#{given => none, peer_args => []}),
    Quiet = convoy_bench_nodes:settle(State),
    ?assert(Quiet < 200, Quiet),
    Stop = erlang:monotonic_time(millisecond) + 300,
    Busy = [spawn(fun() -> spin(Stop) end)
            || _ <- lists:seq(1, 2 * erlang:system_info(schedulers_online))],
    Waited = convoy_bench_nodes:settle(State),
    ?assert(Waited >= 200, Waited),
    [?assertNot(is_process_alive(P)) || P <- Busy].

%% Before convoy stops between variants, what it holds ships: the harness waits
%% while a suspended lane holds 2,000 messages, until the lane runs again.
drain_before_stop(_Config) ->
    ok = convoy_ct_peers:restart_here(),
    try
        {_Peer, Node} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(), #{}),
        Sink = convoy_ct_peers:sink_on(Node),
        ok = convoy:set_config(#{bypass_after => never}), % every message to the lane
        [Lane] = [P || {_, P, _, _} <- supervisor:which_children(convoy_lane_sup)],
        ok = sys:suspend(Lane),
        [ok = convoy:send(Sink, {m, I}) || I <- lists:seq(1, 2000)],
        _ = spawn(fun() -> timer:sleep(500), sys:resume(Lane) end),
        T0 = erlang:monotonic_time(millisecond),
        ok = convoy_bench_nodes:drain([node()]),
        ?assert(erlang:monotonic_time(millisecond) - T0 >= 400),
        #{nodes := #{Node := #{queued := 0}}} = convoy:info(),
        ?assertEqual([{m, I} || I <- lists:seq(1, 2000)], convoy_ct_peers:received(Sink, 2000))
    after
        application:stop(convoy)
    end.

%% The guarded floor keeps convoy's default overload policy, block: a sender
%% that finds the node's bound full waits until there is room, and its message
%% arrives (it was dropped, so `oneway' lost messages of the ~420-byte shape).
guarded_waits_for_room(_Config) ->
    Bench = filename:dirname(code:which(convoy_bench_handover)),
    {Peer, Node} = convoy_ct_peers:start(?MODULE, ?CT_PEER_NAME(), #{args => ["-pa", Bench]}),
    try
        ok = convoy_bench_handover:start([node(), Node]),
        Sink = convoy_ct_peers:sink_on(Node),
        Held = persistent_term:get({convoy_bench_handover, guard}),
        Full = 1000000 bsl 40, % the bound's messages, as the held word counts them
        ok = atomics:add(Held, 1, Full),
        Self = self(),
        _ = spawn_link(fun() ->
                               T0 = erlang:monotonic_time(millisecond),
                               R = convoy_bench_handover:send_guarded(Sink, waited),
                               Self ! {sent, R, erlang:monotonic_time(millisecond) - T0}
                       end),
        receive {sent, _, _} = Early -> ct:fail({did_not_wait, Early}) after 300 -> ok end,
        ok = atomics:sub(Held, 1, Full),
        receive
            {sent, ok, Ms} -> ?assert(Ms >= 300, Ms)
        after 5000 -> ct:fail(still_blocked)
        end,
        ?assertEqual([waited], convoy_ct_peers:received(Sink, 1)),
        ok = convoy_bench_handover:stop([node(), Node])
    after
        peer:stop(Peer)
    end.

spin(Stop) ->
    case erlang:monotonic_time(millisecond) < Stop of
        true -> spin(Stop);
        false -> ok
    end.

deadline_then_flood(Nodes0) ->
    Opts = #{repeat => 1, progress => false, t0 => erlang:monotonic_time()},
    Plain = hd([V || V = #{name := <<"plain">>} <- variants()]),
    Hung = convoy_bench_scenarios:spec(flood, tiny, #{pingers => 1000000, deadline_ms => 1000}),
    {Runs1, Nodes1} = convoy_bench_runner:run(Hung, [Plain], Opts, Nodes0),
    [?assertMatch(#{status := error, note := <<"deadline 1000 ms">>}, Run) || Run <- Runs1],
    Tiny = convoy_bench_scenarios:spec(flood, tiny, #{}),
    {Runs2, Nodes2} = convoy_bench_runner:run(Tiny, variants(), Opts, Nodes1),
    [?assertMatch(#{status := ok}, Run) || Run <- Runs2],
    %% Point by point, the variants' order rotating from one point to the next.
    [#{label := P1}, #{label := P2}] = maps:get(points, Tiny),
    ?assertEqual([{P1, <<"plain">>}, {P1, <<"convoy">>}, {P2, <<"convoy">>}, {P2, <<"plain">>}],
                 [{P, V} || #{point := P, variant := V} <- Runs2]),
    Nodes2.

variants() ->
    {ok, O} = convoy_bench:parse(["--variants", "plain,convoy"]),
    [#{name := <<"plain">>} = Plain, #{name := <<"convoy">>} = Convoy] = convoy_bench:variants(O),
    [Plain, Convoy].

%%--------------------------------------------------------------------
%% Checks

check_scenario(Result = #{name := pubsub, runs := Runs, summary := Summary},
               #{pubsub := false}) ->
    %% Not built here (no Elixir, or no phoenix_pubsub beside the repository):
    %% every run says so.
    [?assertMatch(#{status := unavailable, note := <<"Phoenix.PubSub and its convoy ", _/binary>>},
                  Run) || Run <- Runs],
    [?assertEqual(unavailable, S) || #{status := S} <- Summary],
    ?assertEqual([<<"handover">>, <<"pg2">>, <<"convoy">>, <<"convoy[max_batch=50]">>],
                 maps:get(variants, Result)),
    ok;
check_scenario(Result = #{name := Name, spec := Spec, runs := Runs0, summary := Summary,
                          variants := Variants}, Built) ->
    %% Variants that may not run here, and are reported unavailable: `local'
    %% (flow's two-node points), manifold where it could not be built.
    Unavailable = [<<"local">> | [<<"manifold">> || not maps:get(manifold, Built)]],
    Runs = first_runs(Result, Runs0),
    #{points := Points, figures := Figs, convoy := ConvoyStatus} = Spec,
    Keys = [K || {K, _, _} <- Figs],
    Required = Keys -- maps:get(optional, Spec, []),
    ?assert(Variants =/= []),
    %% p50 and p99 are compared with the baseline wherever they are measured.
    [?assert(lists:member(F, maps:get(ratio, Spec)), {Name, F})
     || F <- [p50_us, p99_us], lists:member(F, Keys)],
    %% Every variant x point x repeat ran (or says why not).
    ?assertEqual(length(Variants) * length(Points) * 2, length(Runs)),
    [begin
         ?assert(lists:member(V, Variants)),
         case {S, ConvoyStatus, is_convoy(V)} of
             {ok, _, _} ->
                 ?assertEqual([], Required -- maps:keys(Fs), {Name, V}),
                 [?assert(is_number(X) andalso X >= 0) || X <- maps:values(Fs)];
             {awaiting, {awaiting, _}, true} ->
                 ?assertEqual(#{}, Fs);
             {unavailable, _, false} ->
                 ?assert(lists:member(V, Unavailable), {Name, V}),
                 ?assertEqual(#{}, Fs);
             Other ->
                 ct:fail({unexpected_run, Name, V, Other, Run})
         end
     end || Run = #{variant := V, status := S, figures := Fs} <- Runs],
    ?assertEqual(length(Variants) * length(Points), length(Summary)),
    Base = convoy_bench_runner:baseline(Spec),
    [case S of
         ok ->
             ?assertEqual([], Required -- maps:keys(FS)),
             ?assertEqual([], maps:keys(FS) -- Keys),
             [?assertMatch(#{median := _, min := _, max := _}, X) || X <- maps:values(FS)],
             V =:= Base orelse
                 ?assertEqual(lists:sort(maps:get(ratio, Spec)), lists:sort(maps:keys(RS)));
         awaiting ->
             ok;
         unavailable ->
             ?assert(lists:member(V, Unavailable), {Name, V})
     end || #{variant := V, status := S, figures := FS, ratios := RS} <- Summary],
    %% The ceiling runs exactly where the scenario has one, and every convoy row
    %% (send_many's too) there is also given as a fraction of it.
    Ceiling = maps:get(ceiling, Spec),
    ?assertEqual(Ceiling, lists:member(<<"ceiling">>, Variants), Name),
    [?assertEqual(case Ceiling andalso has_limits(V) of
                      true -> lists:sort(maps:get(ratio, Spec));
                      false -> []
                  end, lists:sort(maps:keys(CR)), {Name, V})
     || #{variant := V, status := ok, ceiling_ratios := CR} <- Summary],
    %% The same for the handover (oneway, oneway8, flood, pubsub) and, in every
    %% scenario across nodes but pubsub, for the best distribution flag.
    Handover = maps:get(handover, Spec),
    ?assertEqual(Handover, lists:member(<<"handover">>, Variants), Name),
    %% send_many (convoy, lists handed over) and batch (convoy:batch/1 around
    %% convoy's sends) where the scenario has them.
    ?assertEqual(maps:get(send_many, Spec), lists:member(<<"send_many">>, Variants), Name),
    ?assertEqual(maps:get(batch, Spec), lists:member(<<"batch">>, Variants), Name),
    %% pubsub compares Phoenix.PubSub's adapters: pg2, convoy's and the handover's,
    %% nothing else.
    Pubsub = maps:get(pubsub, Spec),
    ?assertEqual(Pubsub, lists:member(<<"pg2">>, Variants), Name),
    Pubsub andalso ?assertEqual([], [V || V <- Variants, V =/= <<"pg2">>, V =/= <<"handover">>,
                                          not is_convoy(V)]),
    Cross = maps:get(placement, Spec) =:= cross andalso not Pubsub,
    ?assertEqual(Cross, lists:member(<<"nodelay_false">>, Variants), Name),
    [?assertEqual({Limit(Handover), Limit(Cross)},
                  {lists:sort(maps:keys(HR)), lists:sort(maps:keys(FR))}, {Name, V})
     || #{variant := V, status := ok, handover_ratios := HR, flag_ratios := FR} <- Summary,
        Limit <- [fun(Ran) ->
                          case Ran andalso has_limits(V) of
                              true -> lists:sort(maps:get(ratio, Spec));
                              false -> []
                          end
                  end]],
    ok.

%% The pubsub scenario's beams (Phoenix.PubSub, its convoy adapter), built with
%% `make phoenix-build' (a second or two once built) wherever Elixir and the
%% phoenix_pubsub source are, so that the scenario is measured there and a broken
%% scenario fails this test; `false' where they are not (the scenario must then
%% say so in every run).
phoenix_build() ->
    elixir_build(#{target => "phoenix-build", tool => "mix", env => "PHOENIX_PUBSUB_PATH",
                   vendor => "phoenix_pubsub", file => "mix.exs",
                   paths => fun convoy_bench_pubsub:code_paths/0}).

%% The same for the fanout scenario's manifold variant: `make manifold-build'
%% wherever elixirc and manifold's source are.
manifold_build() ->
    elixir_build(#{target => "manifold-build", tool => "elixirc", env => "MANIFOLD_PATH",
                   vendor => "manifold", file => "lib/manifold.ex",
                   paths => fun convoy_bench_fanout:manifold_paths/0}).

%% `make Target' when `Tool', make and the source (`$Env', else the copy in
%% shared/vendor beside the repository) are here, then its code paths found;
%% `false' where they are not.
elixir_build(#{target := Target, tool := Tool, env := Env, vendor := Vendor, file := File,
               paths := Paths}) ->
    Root = convoy_bench_pubsub:root(),
    Source = case os:getenv(Env) of
                 P when is_list(P), P =/= "" -> P;
                 _ -> filename:join([Root, "..", "shared", "vendor", Vendor])
             end,
    case os:find_executable(Tool) =/= false andalso os:find_executable("make") =/= false
        andalso filelib:is_regular(filename:join(Source, File)) of
        false ->
            ct:pal("~s: not built here (no ~s, make or ~s)", [Target, Tool, Source]),
            false;
        true ->
            Out = os:cmd("make -C '" ++ Root ++ "' --no-print-directory " ++ Target ++ " 2>&1; "
                         "echo \"exit $?\""),
            ct:pal("make ~s:~n~s", [Target, Out]),
            ?assertNotEqual(nomatch, string:find(Out, "exit 0\n"), Out),
            ?assertMatch({ok, _}, Paths()),
            true
    end.

%% The runs of the two repeats asked for; --confirm's (numbered after them) are
%% only at the points and for the variants it names, and only when it names some.
first_runs(Result = #{spec := Spec}, Runs) ->
    {First, Again} = lists:partition(fun(#{repeat := R}) -> R =< 2 end, Runs),
    Base = convoy_bench_runner:baseline(Spec),
    case maps:get(confirmed, Result, none) of
        none ->
            ?assertEqual([], Again);
        #{points := Ps, variants := Vs, repeats := N} ->
            ?assertEqual(length(Ps) * (1 + length(Vs)) * N, length(Again)),
            [?assert(lists:member(P, Ps) andalso lists:member(V, [Base | Vs]))
             || #{point := P, variant := V} <- Again]
    end,
    First.

is_convoy(<<"convoy", _/binary>>) -> true;
is_convoy(_) -> false.

%% The rows given as fractions of the limits: convoy's, send_many's and batch's
%% included.
has_limits(V) -> is_convoy(V) orelse V =:= <<"send_many">> orelse V =:= <<"batch">>.

check_files(Dir, R = #{scenarios := Scenarios, files := Files}) ->
    [?assert(filelib:is_regular(F), F) || F <- Files],
    [?assert(filelib:is_regular(filename:join(Dir, F)), F)
     || F <- ["table.txt", "results.csv", "results.json"]],
    %% JSON parses and holds what the run returned.
    {ok, Bin} = file:read_file(filename:join(Dir, "results.json")),
    {ok, J} = convoy_bench_json:decode(Bin),
    ?assertEqual([atom_to_binary(N) || #{name := N} <- Scenarios],
                 [N || #{<<"name">> := N} <- maps:get(<<"scenarios">>, J)]),
    ?assertMatch(#{<<"config">> := #{<<"facts">> := #{<<"otp_release">> := _}}}, J),
    %% CSV: the header, then one row per run, each with every column.
    {ok, Csv} = file:read_file(filename:join(Dir, "results.csv")),
    [Header | Rows] = [parse_csv_line(L) || L <- binary:split(Csv, <<"\n">>, [global, trim_all])],
    Cols = [atom_to_binary(C) || C <- convoy_bench_report:csv_columns(R)],
    ?assertEqual(Cols, Header),
    ?assertEqual(length(lists:append([Runs || #{runs := Runs} <- Scenarios])), length(Rows)),
    [?assertEqual(length(Cols), length(Row), Row) || Row <- Rows],
    %% Plots, when gnuplot is here and their scenario ran.
    Ran = [N || #{name := N} <- Scenarios],
    Plots = [P || {S, P} <- [{sizes, "sizes_mb_s.png"}, {pairs, "pairs_rt_s.png"},
                             {latency, "latency_percentiles.png"},
                             {flood, "flood_x_plain.png"}, {oneway, "oneway_x_plain.png"}],
                  lists:member(S, Ran)],
    case os:find_executable("gnuplot") =/= false andalso
        maps:get(plots, maps:get(config, R)) of
        true ->
            [begin
                 {ok, <<137, "PNG", _/binary>>} = file:read_file(filename:join(Dir, P))
             end || P <- Plots];
        false ->
            %% --no-plots (or no gnuplot): nothing drawn
            ?assertEqual([], filelib:wildcard(filename:join(Dir, "*.png")))
    end,
    ok.

%% One CSV line (no embedded newlines are written) into fields, honouring quotes.
parse_csv_line(L) -> fields(L, <<>>, []).

fields(<<>>, Cur, Acc) -> lists:reverse([Cur | Acc]);
fields(<<$", R/binary>>, <<>>, Acc) -> quoted(R, <<>>, Acc);
fields(<<$,, R/binary>>, Cur, Acc) -> fields(R, <<>>, [Cur | Acc]);
fields(<<C, R/binary>>, Cur, Acc) -> fields(R, <<Cur/binary, C>>, Acc).

quoted(<<$", $", R/binary>>, Cur, Acc) -> quoted(R, <<Cur/binary, $">>, Acc);
quoted(<<$", $,, R/binary>>, Cur, Acc) -> fields(R, <<>>, [Cur | Acc]);
quoted(<<$">>, Cur, Acc) -> lists:reverse([Cur | Acc]);
quoted(<<C, R/binary>>, Cur, Acc) -> quoted(R, <<Cur/binary, C>>, Acc).
