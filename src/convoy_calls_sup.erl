%% @private
%% `convoy_calls' on its own: the shared monitors of `convoy:call/2,3' are only an
%% optimisation (callers monitor servers themselves while it is away), so one that
%% fails is restarted alone. Past this supervisor's intensity it stays down until
%% convoy restarts: this supervisor stops with `shutdown', which its parent, for
%% which it is transient, takes as the end of it rather than a failure.
-module(convoy_calls_sup).
-behaviour(supervisor).

-export([start_link/0, init/1]).

-spec start_link() -> {ok, pid()} | {error, term()}.
start_link() ->
    supervisor:start_link({local, ?MODULE}, ?MODULE, []).

%% @private
-spec init([]) -> {ok, {supervisor:sup_flags(), [supervisor:child_spec()]}}.
init([]) ->
    {ok, {#{strategy => one_for_one, intensity => 10, period => 10},
          [#{id => convoy_calls, start => {convoy_calls, start_link, []}}]}}.
