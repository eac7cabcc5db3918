%% @private
%% Top supervisor. one_for_all: the lanes, their counters, the peer table and the
%% table of bytes reserved for partial messages only make sense together.
%% `convoy_calls', an optimisation of calls, is restarted on its own by
%% `convoy_calls_sup', a transient child: when that gives up (it
%% stops with `shutdown') convoy goes on without it, so no failure of
%% convoy_calls restarts the rest. Nothing in convoy crashes on input or on a
%% lane's death (a lane is replaced by convoy_control), so a restart here means
%% convoy itself is broken.
%%
%% Started again right after its previous instance was killed (say by a user's
%% supervisor restarting it), it first waits for that instance's processes to
%% finish shutting down: they hold convoy's registered names, and a start that
%% failed on them would count against the user's restart intensity.
-module(convoy_sup).
-behaviour(supervisor).

-export([start_link/1, init/1]).

%% Control drains the lanes for up to 10 s when convoy stops.
-define(CONTROL_SHUTDOWN, 15000).
%% How long a new start waits for a killed instance's processes to go.
-define(LEFTOVER_WAIT, 20000).

-spec start_link(convoy_config:config()) -> {ok, pid()} | {error, term()}.
start_link(Config) ->
    case whereis(?MODULE) of
        undefined ->
            ok = await_leftovers(),
            ok = load_modules(),
            supervisor:start_link({local, ?MODULE}, ?MODULE, Config);
        Pid ->
            {error, {already_started, Pid}}
    end.

%% @private
-spec init(convoy_config:config()) -> {ok, {supervisor:sup_flags(), [supervisor:child_spec()]}}.
init(Config = #{lanes := Lanes}) ->
    ok = convoy_metrics:init(),
    Children =
        [#{id => convoy_peers, start => {convoy_peers, start_link, [Lanes]}},
         #{id => convoy_chunk_bound, start => {convoy_chunk_bound, start_link, [Lanes]}},
         #{id => convoy_inbox_sup, start => {convoy_inbox_sup, start_link, [Lanes]},
           type => supervisor},
         #{id => convoy_lane_sup, start => {convoy_lane_sup, start_link, []},
           type => supervisor},
         #{id => convoy_calls_sup, start => {convoy_calls_sup, start_link, []},
           type => supervisor, restart => transient},
         #{id => convoy_control, start => {convoy_control, start_link, [Config]},
           shutdown => ?CONTROL_SHUTDOWN}],
    {ok, {#{strategy => one_for_all, intensity => 5, period => 10}, Children}}.

%% Every module of convoy is loaded before it starts. Where code is loaded on
%% first call (a node in interactive mode: a shell, tests, `mix run'), the first
%% burst of senders after a start would otherwise find, say, convoy_path not
%% loaded, and each would wait for the code server, which waits for its turn
%% among them (the harness's first flood on fresh nodes ran at about half the
%% rate of the ones after it). A module that does not load is left to fail
%% where it is called, as it would have.
load_modules() ->
    _ = application:load(convoy),
    case application:get_key(convoy, modules) of
        {ok, Modules} -> _ = code:ensure_modules_loaded(Modules), ok;
        undefined -> ok
    end.

%% Processes of an earlier instance whose supervisor is gone still hold convoy's
%% names while they shut down: wait for them, and kill what outlives the wait.
await_leftovers() ->
    Deadline = erlang:monotonic_time(millisecond) + ?LEFTOVER_WAIT,
    Leftovers = [{erlang:monitor(process, Pid), Pid}
                 || Name <- registered(), is_convoy_name(Name),
                    Pid <- [whereis(Name)], is_pid(Pid)],
    lists:foreach(fun(L) -> await_down(L, Deadline) end, Leftovers).

await_down({Mon, Pid}, Deadline) ->
    receive
        {'DOWN', Mon, process, _, _} -> ok
    after max(0, Deadline - erlang:monotonic_time(millisecond)) ->
        true = exit(Pid, kill),
        receive {'DOWN', Mon, process, _, _} -> ok end
    end.

is_convoy_name(Name) ->
    lists:member(Name, [convoy_peers, convoy_chunk_bound, convoy_inbox_sup, convoy_lane_sup,
                        convoy_calls_sup, convoy_calls, convoy_control])
        orelse lists:prefix("convoy_inbox_", atom_to_list(Name)).
