%% A user's supervisor holding convoy's child_spec, for the Common Test suites.
-module(convoy_test_sup).
-behaviour(supervisor).
-export([start/1, start/2, init/1]).

%% Started from a peer:call, so not linked to the short-lived calling process.
start(Children) ->
    start(Children, 1).

%% Intensity: restarts allowed in 5 s.
start(Children, Intensity) ->
    {ok, Pid} = supervisor:start_link({local, user_sup}, ?MODULE, {Children, Intensity}),
    unlink(Pid),
    {ok, Pid}.

init({Children, Intensity}) ->
    {ok, {#{strategy => one_for_one, intensity => Intensity, period => 5}, Children}}.
