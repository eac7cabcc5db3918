%% @private
%% `convoy:info/0''s report, gathered in one place: the settings and lanes in
%% force (`convoy_control'), the node rows and forgotten nodes (`convoy_peers'),
%% the counters (`convoy_metrics') and the credit channels' totals
%% (`convoy_channel', kept whether or not convoy runs).
-module(convoy_info).

-export([report/0]).

%% @doc The report `convoy:info/0' returns.
-spec report() -> convoy:info().
report() ->
    case convoy_control:status() of
        not_running ->
            #{running => false, settings => #{}, nodes => #{}, lanes => [],
              forgotten => convoy_peers:forgotten(), rejected => convoy_metrics:no_rejections(),
              lost => 0,
              channels => convoy_channel:stats()};
        #{settings := Settings, lanes := Lanes} ->
            #{running => true,
              settings => Settings,
              nodes => maps:from_list([{N, convoy_metrics:node_report(Route, C, H)}
                                       || {N, {Route, C, H}} <- convoy_peers:all()]),
              lanes => Lanes,
              forgotten => convoy_peers:forgotten(),
              rejected => convoy_metrics:rejected(),
              lost => convoy_metrics:lost(),
              channels => convoy_channel:stats()}
    end.
