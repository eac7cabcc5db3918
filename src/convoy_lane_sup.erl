%% @private
%% The outbound lanes, started (and replaced) by convoy_control. Temporary: a lane
%% that dies takes its messages with it, so convoy_control restarts convoy as a whole
%% rather than this supervisor restarting one lane.
-module(convoy_lane_sup).
-behaviour(supervisor).

-export([start_link/0, start_lane/3, init/1]).

-spec start_link() -> {ok, pid()} | {error, term()}.
start_link() ->
    supervisor:start_link({local, ?MODULE}, ?MODULE, []).

-spec start_lane(pos_integer(), none | all, tuple()) -> {ok, pid()} | {error, term()}.
start_lane(Index, Held, Runtime) ->
    supervisor:start_child(?MODULE, [Index, Held, Runtime]).

%% @private
-spec init([]) -> {ok, {supervisor:sup_flags(), [supervisor:child_spec()]}}.
init([]) ->
    Lane = #{id => convoy_lane, start => {convoy_lane, start_link, []},
             restart => temporary, shutdown => 5000},
    {ok, {#{strategy => simple_one_for_one, intensity => 0, period => 1}, [Lane]}}.
