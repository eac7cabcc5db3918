%% EUnit tests of `convoy_bench_bars' (the bar charts of bin/convoy-bench) on
%% scenario results made as the harness makes them: the scenario's own spec and
%% `convoy_bench_runner:summarise/3' over fabricated runs. What the `.dat' and
%% the gnuplot script say; that gnuplot draws them is tested in
%% `convoy_bench_SUITE' (bar_charts), where a test can be skipped when gnuplot
%% is absent.
-module(convoy_bench_bars_tests).

-include_lib("eunit/include/eunit.hrl").

-export([scenario/2]).

%% @doc The result of scenario `Name' (tiny) for `Rates': `[{Variant, [Value]}]',
%% a variant's primary figure at each point in order (`none': its run failed
%% there), one repeat. The other figures are the primary's.
-spec scenario(atom(), [{binary(), [number() | none]}]) -> map().
scenario(Name, Rates) ->
    Spec = #{points := Points, figures := Figs} = convoy_bench_scenarios:spec(Name, tiny, #{}),
    Variants = [#{name => V, kind => kind(V)} || {V, _} <- Rates],
    Runs = [case Value of
                none ->
                    #{variant => V, point => L, repeat => 1, status => error,
                      note => <<"made to fail">>, figures => #{}};
                _ ->
                    #{variant => V, point => L, repeat => 1, status => ok, note => <<>>,
                      figures => maps:from_list([{F, Value} || {F, _, _} <- Figs])}
            end
            || {V, Values} <- Rates, {#{label := L}, Value} <- lists:zip(Points, Values)],
    #{name => Name, spec => Spec, baseline => convoy_bench_runner:baseline(Spec),
      variants => [V || {V, _} <- Rates],
      summary => convoy_bench_runner:summarise(Spec, Variants, Runs)}.

kind(<<"convoy", _/binary>>) -> convoy;
kind(V) -> binary_to_atom(V).

chart(S) ->
    {ok, C} = convoy_bench_bars:chart("pngcairo", S),
    C.

has(Bin, Part) -> binary:match(Bin, iolist_to_binary(Part)) =/= nomatch.

%% A row per point: its index, each variant's ratio to plain (plain itself is the
%% line at 1, not a bar), '?' where the variant has none, the label.
flood_dat_test() ->
    S = scenario(flood, [{<<"plain">>, [100, 200]}, {<<"ceiling">>, [400, 300]},
                         {<<"handover">>, [150, none]}, {<<"convoy">>, [250, 100]}]),
    #{base := Base, dat := Dat} = chart(S),
    ?assertEqual("flood_x_plain", Base),
    ?assertEqual([<<"# \"i\" \"ceiling\" \"handover\" \"convoy\" \"point\"">>,
                  <<"0 4.0 1.5 2.5 \"2000 pingers, ping\"">>,
                  <<"1 1.5 ? 0.5 \"2000 pingers, event\"">>],
                 binary:split(Dat, <<"\n">>, [global, trim_all])).

%% The limits are hatched and say so in the key; convoy and the others are solid,
%% in colours unlike the limits'; the line at 1 is the baseline.
styles_test() ->
    %% (points: atom, event, phoenix)
    S = scenario(oneway, [{<<"plain">>, [100, 100, 100]}, {<<"nodelay_false">>, [90, 110, 100]},
                          {<<"ceiling">>, [900, 500, 400]}, {<<"handover">>, [300, 200, 200]},
                          {<<"guarded">>, [250, 150, 150]}, {<<"convoy">>, [80, 120, 110]},
                          {<<"convoy[lanes=2]">>, [85, 125, 115]}]),
    #{script := Gp} = chart(S),
    Lines = binary:split(Gp, <<"\n">>, [global]),
    Style = fun(V) ->
                    [L] = [L || L <- Lines, has(L, ["title '", V, "'"])],
                    L
            end,
    [begin
         ?assert(has(Style([V, " (limit)"]), "fs pattern"), V),
         ?assertNot(has(Style([V, " (limit)"]), "fs solid"), V)
     end || V <- ["ceiling", "handover", "guarded"]],
    [?assert(has(Style(V), "fs solid"), V)
     || V <- ["nodelay_false", "convoy", "convoy[lanes=2]"]],
    Colour = fun(L) -> hd(binary:split(lists:last(binary:split(L, <<"lc rgb '">>)), <<"'">>)) end,
    Colours = [Colour(Style(V)) || V <- ["ceiling (limit)", "handover (limit)",
                                         "guarded (limit)", "convoy", "convoy[lanes=2]",
                                         "nodelay_false"]],
    ?assertEqual(length(Colours), length(lists:usort(Colours))),
    ?assert(has(Gp, "1 with lines lc rgb 'black' lw 2 title 'plain = 1'")),
    ?assertNot(has(Gp, "title 'plain'")),
    ?assert(has(Gp, "set title 'oneway: msg/s, x plain (median of per-repeat ratios)'")),
    ?assert(has(Gp, "set ylabel 'x plain (msg/s; higher is better)'")),
    ?assert(has(Gp, "set output 'oneway_x_plain.png'")),
    %% each ratio written at its bar's end: 9.00 (ceiling, atom), 0.80 (convoy, atom)
    ?assert(has(Gp, "set label '9.00' at ")),
    ?assert(has(Gp, "set label '0.80' at ")),
    %% y from below the lowest ratio to above the highest, 1 among the tics
    ?assert(has(Gp, "set logscale y")),
    ?assert(has(Gp, "'1' 1.0")).

%% The same-node scenario is against `local'; pubsub against `pg2'.
baselines_test() ->
    L = scenario(local, [{<<"local">>, [1000]}, {<<"local_call">>, [900]},
                         {<<"convoy">>, [950]}]),
    #{base := "local_x_local", script := Gp, dat := Dat} = chart(L),
    ?assert(has(Gp, "title 'local = 1'")),
    ?assert(has(Gp, "x local (oneway msg/s; higher is better)")),
    ?assert(has(Dat, "0 0.9 0.95 \"same node\"")),
    P = scenario(pubsub, [{<<"pg2">>, [10, 20]}, {<<"convoy">>, [20, 10]}]),
    #{base := "pubsub_x_pg2", dat := PDat} = chart(P),
    ?assert(has(PDat, "0 2.0 \"1 publisher\"")).

%% A figure where lower is better says so (the ratio stays the table's).
lower_is_better_test() ->
    S = scenario(latency, [{<<"plain">>, [100, 100]}, {<<"convoy">>, [50, 200]}]),
    #{script := Gp, dat := Dat} = chart(S),
    ?assert(has(Gp, "x plain (p50; lower is better)")),
    ?assert(has(Dat, "0 0.5 \"idle\"")),
    ?assert(has(Dat, "1 2.0 \"after burst\"")).

%% No bar to draw: only the baseline ran, or it failed everywhere.
no_chart_test() ->
    Only = scenario(flood, [{<<"plain">>, [100, 200]}]),
    ?assertMatch({error, <<"no flood_x_plain.png: no variant has a ratio to plain", _/binary>>},
                 convoy_bench_bars:chart("png", Only)),
    Failed = scenario(flood, [{<<"plain">>, [none, none]}, {<<"convoy">>, [100, 100]}]),
    ?assertMatch({error, _}, convoy_bench_bars:chart("png", Failed)).

%% A variant that measured nothing has no bar (a log scale has no 0), and no
%% column where it never has one; a label's characters are kept.
zero_test() ->
    S0 = scenario(bulk, [{<<"plain">>, [100, 100]}, {<<"convoy">>, [0, 50]},
                         {<<"delay_send">>, [0, 0]}]),
    #{dat := Dat} = chart(S0),
    ?assertNot(has(Dat, "delay_send")),
    ?assert(has(Dat, "\n0 ? \"1 sender\"\n")),
    ?assert(has(Dat, "\n1 0.5 \"4 senders\"\n")),
    [P1, P2] = maps:get(points, maps:get(spec, S0)),
    Points = [P1#{label := <<"1 sender, \"µ\""/utf8>>}, P2],
    S = scenario(bulk, [{<<"plain">>, [100, 100]}, {<<"convoy">>, [50, 50]}]),
    Summary = [R#{point := case P of
                               <<"1 sender">> -> <<"1 sender, \"µ\""/utf8>>;
                               _ -> P
                           end} || R = #{point := P} <- maps:get(summary, S)],
    #{dat := UDat, script := UGp} =
        chart(S#{spec := (maps:get(spec, S))#{points := Points}, summary := Summary}),
    ?assert(has(UDat, <<"0 0.5 \"1 sender, 'µ'\""/utf8>>)),
    ?assert(has(UGp, <<"\"1 sender, \\\"µ\\\"\" 0"/utf8>>)).

%% Many points: the labels wrap under their groups, the canvas widens, the values
%% stand upright.
many_points_test() ->
    S = scenario(flow, [{<<"plain">>, [1, 1, 1, 1, 1, 1]},
                        {<<"nodelay_false">>, [2, 2, 2, 2, 2, 2]},
                        {<<"delay_send">>, [2, 2, 2, 2, 2, 2]},
                        {<<"convoy">>, [3, 3, 3, 3, 3, 0.5]}]),
    #{script := Gp} = chart(S),
    ?assert(has(Gp, "set terminal pngcairo size 900,560 noenhanced")),
    ?assert(has(Gp, "rotate by 90")),
    ?assert(has(Gp, "\"channel\\nW=1000,\\nsame node\" 4")),
    Wide = scenario(oneway, [{<<"plain">>, [1, 1, 1]}]
                    ++ [{V, [2, 2, 2]} || V <- [<<"nodelay_false">>, <<"delay_send">>,
                                             <<"ceiling">>, <<"handover">>, <<"guarded">>,
                                             <<"send_many">>, <<"convoy">>,
                                             <<"convoy[lanes=2]">>, <<"convoy[lanes=4]">>,
                                             <<"convoy[lanes=8]">>]]),
    #{script := WGp} = chart(Wide),
    %% 10 variants x 3 points: 330 + 30 px a bar
    ?assert(has(WGp, "set terminal pngcairo size 1230,560 noenhanced")).
