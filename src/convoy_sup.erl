%% @private
%% Top supervisor. one_for_all: the lanes, the admission counters and the peer table
%% only make sense together, so a crash in one restarts convoy as a whole.
-module(convoy_sup).
-behaviour(supervisor).

-export([start_link/1, init/1]).

-spec start_link(convoy_config:config()) -> {ok, pid()} | {error, term()}.
start_link(Config) ->
    supervisor:start_link({local, ?MODULE}, ?MODULE, Config).

%% @private
-spec init(convoy_config:config()) -> {ok, {supervisor:sup_flags(), [supervisor:child_spec()]}}.
init(Config = #{lanes := Lanes}) ->
    ok = convoy_metrics:init(),
    Children =
        [#{id => convoy_peers, start => {convoy_peers, start_link, [Lanes]}},
         #{id => convoy_inbox_sup, start => {convoy_inbox_sup, start_link, [Lanes]},
           type => supervisor},
         #{id => convoy_lane_sup, start => {convoy_lane_sup, start_link, []},
           type => supervisor},
         #{id => convoy_control, start => {convoy_control, start_link, [Config]}}],
    {ok, {#{strategy => one_for_all, intensity => 5, period => 10}, Children}}.
