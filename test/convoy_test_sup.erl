%% A user's supervisor holding convoy's child_spec, for convoy_SUITE.
-module(convoy_test_sup).
-behaviour(supervisor).
-export([start/1, init/1]).

%% Started from a peer:call, so not linked to the short-lived calling process.
start(Children) ->
    {ok, Pid} = supervisor:start_link({local, user_sup}, ?MODULE, Children),
    unlink(Pid),
    {ok, Pid}.

init(Children) ->
    {ok, {#{strategy => one_for_one, intensity => 1, period => 5}, Children}}.
