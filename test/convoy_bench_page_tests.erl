%% The results page (`bin/convoy-bench page DIR'): the run's command, host and
%% commit first; per scenario, every variant's primary figure with its ratios, the
%% ratio to `guarded' and batch's to convoy (`beside_ratios') as the summary gives
%% them, and the scenario's charts only.
-module(convoy_bench_page_tests).

-include_lib("eunit/include/eunit.hrl").

page_test() ->
    Text = iolist_to_binary(convoy_bench_page:page(result(), ["charts/oneway_x_plain.png",
                                                              "charts/oneway8_x_plain.png"])),
    Has = fun(S) -> ?assertNotEqual(nomatch, binary:match(Text, S), S) end,
    Hasnt = fun(S) -> ?assertEqual(nomatch, binary:match(Text, S), S) end,
    Has(<<"bin/convoy-bench --scenario oneway --variants plain,guarded,convoy">>),
    Has(<<"| commit | abc1234 |">>),
    Has(<<"| CPU | AMD EPYC, 2 logical processors |">>),
    Has(<<"| memory | 23.5 GiB |">>),
    Has(<<"`--check`: 1 of 2 convoy cells">>),
    %% convoy over guarded as the summary gives it (for convoy only)
    Has(<<"| 1000 msgs, atom | plain | 250 k [250 k - 250 k] |  |  |  |">>),
    Has(<<"| point | variant | msg/s | x plain | x guarded | x convoy |">>),
    %% batch beside convoy, as the summary gives it
    Has(<<"| 1000 msgs, atom | batch | 2.00 M [2.00 M - 2.00 M] | 8.00 |  | 0.80 |">>),
    Has(<<"| 1000 msgs, atom | convoy | 2.50 M [2.00 M - 3.00 M] | 10.0 | 1.75 |  |">>),
    Has(<<"![oneway: oneway_x_plain](charts/oneway_x_plain.png)">>),
    Hasnt(<<"oneway8_x_plain">>),  % another scenario's chart
    Hasnt(<<"| local |">>).       % `!' on one node only in `local'

%% A run given with `--also' follows under its own heading, with the command
%% as typed (a `--netns --rate' run records the arguments the namespace got) and
%% its host; its scenarios one level down.
also_test() ->
    #{<<"config">> := C} = Main = result(),
    Capped = Main#{<<"config">> :=
                       C#{<<"args">> := [<<"--nodes">>, <<"a@10.77.0.1,b@10.77.0.2">>,
                                         <<"--nodes-note">>, <<"network namespaces: A=...">>,
                                         <<"--link-rate">>, <<"100mbit">>,
                                         <<"--scenario">>, <<"oneway">>, <<"--variants">>,
                                         <<"plain,convoy,convoy[compress=auto]">>],
                          <<"commit">> := <<"def5678">>}},
    Text = iolist_to_binary(convoy_bench_page:page(Main, [], [maps:remove(<<"check">>, Capped)])),
    Has = fun(S) -> ?assertNotEqual(nomatch, binary:match(Text, S), S) end,
    Has(<<"## Another run: oneway on a link capped at 100mbit">>),
    Has(<<"bin/convoy-bench --netns --rate 100mbit --scenario oneway "
          "--variants 'plain,convoy,convoy[compress=auto]'">>),
    Has(<<"| commit | def5678 |">>),
    Has(<<"### oneway">>),
    ?assertEqual(1, length(binary:matches(Text, <<"`--check`">>))),
    ?assertEqual(1, length(binary:matches(Text, <<"# Results">>))).

result() ->
    Spread = fun(Md, Lo, Hi) ->
                     #{<<"median">> => Md, <<"min">> => Lo, <<"max">> => Hi, <<"n">> => 2}
             end,
    Summary = fun(V, Fig, Ratios, Guarded) ->
                      #{<<"status">> => <<"ok">>, <<"point">> => <<"1000 msgs, atom">>,
                        <<"variant">> => V, <<"figures">> => #{<<"msg_s">> => Fig},
                        <<"ratios">> => Ratios, <<"flag_ratios">> => #{},
                        <<"handover_ratios">> => #{}, <<"guarded_ratios">> => Guarded,
                        <<"ceiling_ratios">> => #{}}
              end,
    #{<<"config">> =>
          #{<<"args">> => [<<"--scenario">>, <<"oneway">>, <<"--variants">>,
                           <<"plain,guarded,convoy">>],
            <<"started">> => <<"2026-11-29 08:00:00">>, <<"commit">> => <<"abc1234">>,
            <<"seconds">> => 60.0, <<"nodes">> => <<"peer nodes">>,
            <<"facts">> => #{<<"host">> => <<"vm">>, <<"cpu_model">> => <<"AMD EPYC">>,
                             <<"logical_processors">> => 2, <<"memory_gib">> => 23.5,
                             <<"os">> => <<"Debian">>, <<"otp_release">> => <<"25">>,
                             <<"erts_version">> => <<"13.1.5">>,
                             <<"schedulers_online">> => 2}},
      <<"check">> => #{<<"within">> => 1, <<"cells">> => 2, <<"failures">> => []},
      <<"scenarios">> =>
          [#{<<"name">> => <<"oneway">>, <<"title">> => <<"one sender">>,
             <<"spec">> => #{<<"primary">> => #{<<"figure">> => <<"msg_s">>,
                                                <<"better">> => <<"higher">>},
                             <<"figures">> => [#{<<"key">> => <<"msg_s">>,
                                                 <<"label">> => <<"msg/s">>,
                                                 <<"unit">> => <<"rate">>}]},
             <<"summary">> => [Summary(<<"local">>, Spread(9.0e6, 9.0e6, 9.0e6), #{}, #{}),
                               Summary(<<"plain">>, Spread(2.5e5, 2.5e5, 2.5e5), #{}, #{}),
                               Summary(<<"guarded">>, Spread(1.5e6, 1.0e6, 2.0e6), #{}, #{}),
                               Summary(<<"convoy">>, Spread(2.5e6, 2.0e6, 3.0e6),
                                       #{<<"msg_s">> => Spread(10.0, 8.0, 12.0)},
                                       #{<<"msg_s">> => Spread(1.75, 1.5, 2.0)}),
                               (Summary(<<"batch">>, Spread(2.0e6, 2.0e6, 2.0e6),
                                        #{<<"msg_s">> => Spread(8.0, 8.0, 8.0)}, #{}))#{
                                 <<"beside_ratios">> =>
                                     #{<<"convoy">> => #{<<"msg_s">> => Spread(0.8, 0.7, 0.9)}}}
                              ]}]}.
