%% @private
%% The inboxes, `convoy_inbox_1..N', N fixed when convoy starts. An inbox holds no
%% state worth keeping, so one that fails is simply restarted.
-module(convoy_inbox_sup).
-behaviour(supervisor).

-export([start_link/1, init/1]).

-spec start_link(pos_integer()) -> {ok, pid()} | {error, term()}.
start_link(N) ->
    supervisor:start_link({local, ?MODULE}, ?MODULE, N).

%% @private
-spec init(pos_integer()) -> {ok, {supervisor:sup_flags(), [supervisor:child_spec()]}}.
init(N) ->
    Children = [#{id => {convoy_inbox, I}, start => {convoy_inbox, start_link, [I]}}
                || I <- lists:seq(1, N)],
    {ok, {#{strategy => one_for_one, intensity => 10, period => 10}, Children}}.
