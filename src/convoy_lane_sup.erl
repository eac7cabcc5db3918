%% @private
%% The outbound lanes, started (and replaced) by convoy_control. Temporary: a lane
%% that dies is replaced by convoy_control, which counts what it held, rather than
%% restarted here.
-module(convoy_lane_sup).
-behaviour(supervisor).

-export([start_link/0, start_lane/4, init/1]).

-spec start_link() -> {ok, pid()} | {error, term()}.
start_link() ->
    supervisor:start_link({local, ?MODULE}, ?MODULE, []).

-spec start_lane(pos_integer(), none | all | [node()], tuple(), {pid(), reference()}) ->
          {ok, pid()} | {error, term()}.
start_lane(Index, Held, Runtime, Control) ->
    supervisor:start_child(?MODULE, [Index, Held, Runtime, Control]).

%% @private
-spec init([]) -> {ok, {supervisor:sup_flags(), [supervisor:child_spec()]}}.
init([]) ->
    %% A lane told to stop reads its mailbox, ships what can leave at once and
    %% counts the rest: far less than this.
    Lane = #{id => convoy_lane, start => {convoy_lane, start_link, []},
             restart => temporary, shutdown => 5000},
    {ok, {#{strategy => simple_one_for_one, intensity => 0, period => 1}, [Lane]}}.
