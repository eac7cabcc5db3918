%% EUnit tests of the limits convoy is compared with beside `plain' in the bench's
%% summaries (`convoy_bench_runner:summarise/3'), on fabricated runs: the
%% `handover' variant and the best distribution flag (the better of
%% `nodelay_false' and `delay_send' in the same repeat: the higher rate, the lower
%% time), only for the convoy variants and only where the limit ran; and where
%% the variants run at all (`variants_for/2'), and the other variants a row is
%% compared with (`beside_ratios': `batch''s with `convoy' and `send_many',
%% convoy's with `manifold').
-module(convoy_bench_limits_tests).

-include_lib("eunit/include/eunit.hrl").

variants(Names) ->
    {ok, O} = convoy_bench:parse(["--variants", lists:flatten(lists:join(",", Names))]),
    convoy_bench:variants(O).

run(Spec, Variant, Repeat, Figures) ->
    [#{label := Label} | _] = maps:get(points, Spec),
    #{scenario => maps:get(name, Spec), variant => Variant, repeat => Repeat, point => Label,
      status => ok, note => <<>>, figures => Figures, seconds => 0.1}.

row(Variant, Summary) ->
    hd([R || R = #{variant := V} <- Summary, V =:= Variant]).

median(Key, Fig, Row) ->
    #{Fig := #{median := M}} = maps:get(Key, Row),
    M.

%% oneway: msg/s; the best flag is the faster of the two in each repeat.
oneway_test() ->
    Spec = convoy_bench_scenarios:spec(oneway, tiny, #{}),
    Vs = variants(["plain", "nodelay_false", "delay_send", "handover", "guarded", "convoy"]),
    Runs = [run(Spec, <<"plain">>, 1, #{msg_s => 100, ns_msg => 1}),
            run(Spec, <<"nodelay_false">>, 1, #{msg_s => 200, ns_msg => 1}),
            run(Spec, <<"delay_send">>, 1, #{msg_s => 400, ns_msg => 1}),
            run(Spec, <<"handover">>, 1, #{msg_s => 1000, ns_msg => 1}),
            run(Spec, <<"guarded">>, 1, #{msg_s => 400, ns_msg => 1}),
            run(Spec, <<"convoy">>, 1, #{msg_s => 800, ns_msg => 1}),
            run(Spec, <<"plain">>, 2, #{msg_s => 100, ns_msg => 1}),
            %% repeat 2: delay_send failed, nodelay_false alone is the best flag
            run(Spec, <<"nodelay_false">>, 2, #{msg_s => 300, ns_msg => 1}),
            (run(Spec, <<"delay_send">>, 2, #{}))#{status := error},
            run(Spec, <<"handover">>, 2, #{msg_s => 1000, ns_msg => 1}),
            run(Spec, <<"guarded">>, 2, #{msg_s => 200, ns_msg => 1}),
            run(Spec, <<"convoy">>, 2, #{msg_s => 600, ns_msg => 1})],
    Summary = convoy_bench_runner:summarise(Spec, Vs, Runs),
    Convoy = row(<<"convoy">>, Summary),
    ?assertEqual(7.0, median(ratios, msg_s, Convoy)),
    %% repeat 1: 800 / 400; repeat 2: 600 / 300
    ?assertEqual(#{median => 2.0, min => 2.0, max => 2.0, n => 2},
                 maps:get(msg_s, maps:get(flag_ratios, Convoy))),
    ?assertEqual(#{median => 0.7, min => 0.6, max => 0.8, n => 2},
                 maps:get(msg_s, maps:get(handover_ratios, Convoy))),
    %% repeat 1: 800 / 400; repeat 2: 600 / 200
    ?assertEqual(#{median => 2.5, min => 2.0, max => 3.0, n => 2},
                 maps:get(msg_s, maps:get(guarded_ratios, Convoy))),
    %% guarded against the handover, not against itself
    Guarded = row(<<"guarded">>, Summary),
    ?assert(abs(median(handover_ratios, msg_s, Guarded) - 0.3) < 1.0e-9), % 400 / 1000, 200 / 1000
    ?assertEqual(#{}, maps:get(guarded_ratios, Guarded)),
    %% no ceiling ran: no ratio to it
    ?assertEqual(#{}, maps:get(ceiling_ratios, Convoy)),
    %% only convoy's rows carry the limits (and guarded's its handover)
    [?assertEqual({#{}, #{}, #{}}, {maps:get(flag_ratios, R), maps:get(handover_ratios, R),
                                   maps:get(guarded_ratios, R)})
     || R = #{variant := V} <- Summary, V =/= <<"convoy">>, V =/= <<"guarded">>].

%% pairs: no handover there; for a time (p50) the best flag is the lower one.
pairs_test() ->
    Spec = convoy_bench_scenarios:spec(pairs, tiny, #{}),
    Vs = variants(["plain", "nodelay_false", "delay_send", "handover", "convoy"]),
    ?assertNot(lists:member(<<"handover">>,
                            [N || #{name := N} <- convoy_bench_runner:variants_for(Spec, Vs)])),
    Fig = fun(Rt, P50) -> #{rt_s => Rt, p50_us => P50, p99_us => 10, p999_us => 10} end,
    Runs = [run(Spec, <<"plain">>, 1, Fig(100, 50)),
            run(Spec, <<"nodelay_false">>, 1, Fig(120, 40)),
            run(Spec, <<"delay_send">>, 1, Fig(150, 80)),
            run(Spec, <<"handover">>, 1, Fig(1000, 1)),
            run(Spec, <<"convoy">>, 1, Fig(300, 60))],
    Summary = convoy_bench_runner:summarise(Spec, Vs, Runs),
    Convoy = row(<<"convoy">>, Summary),
    ?assertEqual(2.0, median(flag_ratios, rt_s, Convoy)),
    ?assertEqual(1.5, median(flag_ratios, p50_us, Convoy)),
    ?assertEqual(#{}, maps:get(handover_ratios, Convoy)).

%% The handover runs in oneway, oneway8, flood, cast, mesh and pubsub only.
where_test() ->
    ?assertEqual([cast, flood, mesh, oneway, oneway8, pubsub],
                 lists:sort([N || N <- convoy_bench_scenarios:names(),
                                  maps:get(handover, convoy_bench_scenarios:spec(N, tiny, #{}))])),
    %% in pubsub beside PG2's adapter and convoy's, and no other variant
    Vs = variants(["plain", "delay_send", "ceiling", "handover", "send_many", "pg2", "convoy"]),
    ?assertEqual([<<"handover">>, <<"pg2">>, <<"convoy">>],
                 [N || #{name := N} <- convoy_bench_runner:variants_for(
                                          convoy_bench_scenarios:spec(pubsub, tiny, #{}), Vs)]).

%% batch (convoy:batch/1 around convoy's sends) runs where a scenario says so:
%% oneway, oneway8, pairs and latency.
batch_where_test() ->
    Vs = variants(["plain", "send_many", "batch", "convoy"]),
    Runs = fun(N) ->
                   Spec = convoy_bench_scenarios:spec(N, tiny, #{}),
                   [V || #{name := V} <- convoy_bench_runner:variants_for(Spec, Vs)]
           end,
    Ran = [N || N <- convoy_bench_scenarios:names(), lists:member(<<"batch">>, Runs(N))],
    ?assertEqual([latency, oneway, oneway8, pairs], lists:sort(Ran)),
    ?assertEqual(Ran, [N || N <- convoy_bench_scenarios:names(),
                            maps:get(batch, convoy_bench_scenarios:spec(N, tiny, #{}))]).

%% batch's rows are also given against convoy and send_many, repeat by repeat,
%% where they ran (and against the limits, as convoy's); no other row is.
batch_beside_test() ->
    Spec = convoy_bench_scenarios:spec(oneway, tiny, #{}),
    Vs = variants(["plain", "handover", "send_many", "batch", "convoy"]),
    Runs = [run(Spec, V, R, #{msg_s => X, ns_msg => 1})
            || {R, Xs} <- [{1, [100, 1000, 900, 400, 800]}, {2, [100, 1000, 600, 600, 500]}],
               {V, X} <- lists:zip([<<"plain">>, <<"handover">>, <<"send_many">>, <<"batch">>,
                                    <<"convoy">>], Xs)],
    Summary = convoy_bench_runner:summarise(Spec, Vs, Runs),
    Batch = row(<<"batch">>, Summary),
    %% repeat 1: 400 / 800, 400 / 900; repeat 2: 600 / 500, 600 / 600
    #{<<"convoy">> := #{msg_s := #{median := ToConvoy, min := 0.5, max := 1.2}},
      <<"send_many">> := #{msg_s := #{median := ToMany}}} = maps:get(beside_ratios, Batch),
    ?assert(abs(ToConvoy - 0.85) < 1.0e-9),
    ?assert(abs(ToMany - (400 / 900 + 1) / 2) < 1.0e-9),
    ?assertEqual(#{median => 0.5, min => 0.4, max => 0.6, n => 2},
                 maps:get(msg_s, maps:get(handover_ratios, Batch))),
    [?assertEqual(#{}, maps:get(beside_ratios, R)) || R = #{variant := V} <- Summary,
                                                      V =/= <<"batch">>],
    %% pairs has no send_many: batch against convoy only
    Pairs = convoy_bench_scenarios:spec(pairs, tiny, #{}),
    Fig = fun(Rt) -> #{rt_s => Rt, p50_us => 10, p99_us => 10, p999_us => 10} end,
    PairRuns = [run(Pairs, <<"plain">>, 1, Fig(100)), run(Pairs, <<"batch">>, 1, Fig(90)),
                run(Pairs, <<"convoy">>, 1, Fig(120))],
    PairSummary = convoy_bench_runner:summarise(Pairs, convoy_bench_runner:variants_for(Pairs, Vs),
                                                PairRuns),
    ?assertEqual([<<"convoy">>], maps:keys(maps:get(beside_ratios,
                                                    row(<<"batch">>, PairSummary)))).

%% manifold (Manifold.send/2) runs in fanout only, beside plain and convoy, as
%% pg2 runs in pubsub only; convoy's rows there are also given against it.
manifold_where_test() ->
    Vs = variants(["plain", "handover", "send_many", "batch", "pg2", "manifold", "convoy"]),
    Runs = fun(N) ->
                   Spec = convoy_bench_scenarios:spec(N, tiny, #{}),
                   [V || #{name := V} <- convoy_bench_runner:variants_for(Spec, Vs)]
           end,
    ?assertEqual([fanout], [N || N <- convoy_bench_scenarios:names(),
                                 lists:member(<<"manifold">>, Runs(N))]),
    ?assertEqual([<<"plain">>, <<"manifold">>, <<"convoy">>], Runs(fanout)),
    ?assertEqual([pubsub], [N || N <- convoy_bench_scenarios:names(),
                                 lists:member(<<"pg2">>, Runs(N))]),
    Spec = convoy_bench_scenarios:spec(fanout, tiny, #{}),
    Fig = fun(D) -> #{round_ms => 1, deliveries_s => D} end,
    Summary = convoy_bench_runner:summarise(
                Spec, convoy_bench_runner:variants_for(Spec, Vs),
                [run(Spec, <<"plain">>, 1, Fig(100)), run(Spec, <<"manifold">>, 1, Fig(400)),
                 run(Spec, <<"convoy">>, 1, Fig(200))]),
    ?assertEqual(#{<<"manifold">> => #{deliveries_s => #{median => 0.5, min => 0.5, max => 0.5,
                                                         n => 1}}},
                 maps:get(beside_ratios, row(<<"convoy">>, Summary))),
    ?assertEqual(#{}, maps:get(beside_ratios, row(<<"manifold">>, Summary))).

%% On a capped link (`--netns --rate', which passes `--link-rate' on) `sizes'
%% sends what the link carries in 2 s per point; `--param' still wins; other
%% scenarios are untouched.
link_rate_test() ->
    {ok, #{params := P}} = convoy_bench:parse(["--link-rate", "100mbit"]),
    ?assertEqual(#{link_rate => 12500000}, P),
    ?assertMatch({error, _}, convoy_bench:parse(["--link-rate", "fast"])),
    #{params := Sizes} = convoy_bench_scenarios:spec(sizes, normal, P),
    ?assertMatch(#{budget := 25000000, min_count := 10}, Sizes),
    #{params := Given} = convoy_bench_scenarios:spec(sizes, normal, P#{budget => 1000}),
    ?assertMatch(#{budget := 1000, min_count := 10}, Given),
    #{params := Fast} = convoy_bench_scenarios:spec(sizes, tiny, #{link_rate => 1 bsl 40}),
    #{params := Tiny} = convoy_bench_scenarios:spec(sizes, tiny, #{}),
    ?assertEqual(maps:get(budget, Tiny), maps:get(budget, Fast)), % never above the budget
    ?assertEqual(convoy_bench_scenarios:spec(oneway, normal, #{}),
                 convoy_bench_scenarios:spec(oneway, normal, P)).
