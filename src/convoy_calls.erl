%% @private
%% One monitor per remote server that `convoy:call/2,3' calls by pid, shared by
%% every caller on this node (a `{Name, Node}' is not watched here: a monitor
%% resolves the name once, and the name may change hands). `gen_server:call'
%% monitors the server for each call: two distribution signals (monitor,
%% demonitor) beside the request and the reply, and they, not the request, limit
%% many concurrent callers. Here a caller registers in an ETS table instead
%% (local, no signal), and the server's `DOWN' reaches this process once, which
%% passes it on to each caller then waiting.
%%
%% This process takes and drops no remote monitor itself: each is a distribution
%% signal, and on a full distribution buffer its sender is suspended until the
%% buffer drains (a stalled node: until it is declared down), which would hold
%% back the `DOWN' of servers on every other node. Each watched server has a
%% watcher instead, a small process linked to this one (which traps exits) that
%% takes the monitor, reports `{?TAG_CALLS_WATCHING, Watcher}' once it has it,
%% and exits `{?TAG_CALLS_WATCH_DOWN, Reason}' with the server's `DOWN'. The
%% monitor is dropped by killing the watcher, a local signal: the runtime
%% removes a dead process's monitors without suspending anyone. A watcher ends
%% with this process.
%%
%% Tables (this process owns both; they go with it):
%% <ul>
%% <li>`convoy_call_watched' (protected set): `{Process}' for each server whose
%%   watcher holds its monitor now, read by callers (a server there is
%%   watched);</li>
%% <li>`convoy_call_waiters' (public set): `{Alias, Process, Caller}' for each
%%   call in progress, written by the callers themselves (keyed by the call's
%%   alias: a bag keyed by the server made 256 concurrent callers of one server
%%   scan each other's entries on every insert and delete). A caller killed
%%   mid-call cannot remove its entry: each sweep removes those of callers that
%%   are no longer alive.</li>
%% </ul>
%% A server not watched yet: the caller watches it itself for that call (a
%% watcher of the call's own, `convoy_gen') and asks this process (a cast) to
%% watch it from then on.
%%
%% Why no caller misses a `DOWN': a server enters `convoy_call_watched' only once
%% its monitor is taken, so the monitor was set up before any request of a
%% caller relying on it (the server's exit reason reaches such a caller, as
%% gen_server:call's own monitor would give it). A caller registers first, then
%% looks for the server in `convoy_call_watched', and relies on the shared
%% monitor only if it is there. This process, when a monitor ends (its watcher's
%% exit, or the sweep below), first removes the server from
%% `convoy_call_watched', then reads the waiters. A caller that saw the server
%% watched registered before that removal, so it is among the waiters read; one
%% that did not see it watches the server itself. A watcher that dies otherwise
%% (killed by someone else) is replaced at once; the server stays watched, and
%% the new monitor gives the `DOWN' (`noproc' if the server died meanwhile).
%%
%% A call that starts after the server died but before its `DOWN' reached this
%% process exits with the server's exit reason, not `noproc': as a call made just
%% before the death would (gen_server:call's own monitor would say `noproc').
%%
%% Monitors of servers nobody waits on are dropped every `SWEEP_MS' (a server
%% called again is watched again: one monitor signal per sweep at most), so the
%% number of monitors stays that of servers called lately. A sweep is the
%% message of the one timer this process keeps, `{timeout, Timer, sweep}' with
%% `Timer' in its state: a look-alike from elsewhere cannot start a sweep nor add
%% a timer. A watcher killed by a sweep stays known (`ended') until its `EXIT':
%% what it sent before is taken and ignored.
%% The `DOWN' passed on is ``{'$convoy_call_down', Alias, Reason}'' sent to the
%% caller's alias: once the call is over the alias is inactive and the message
%% is dropped by the runtime. A caller also monitors this process during its
%% call: if it goes, the caller watches the server itself (`convoy_gen').
%%
%% Anything else that reaches this process is counted as rejected
%% (`unknown_message') and changes nothing.
-module(convoy_calls).
-behaviour(gen_server).

-include("convoy_tags.hrl").

-export([start_link/0, watch/2, unwatch/2]).
-export([init/1, handle_call/3, handle_cast/2, handle_info/2]).
-export([watcher/2]).

-define(WATCHED, convoy_call_watched).
-define(WAITERS, convoy_call_waiters).
-define(SWEEP_MS, 5000).

-record(s, {%% each watched server's watcher
            watchers = #{} :: #{pid() => pid()},
            %% each live watcher's server, `ended' once killed by a sweep
            servers = #{} :: #{pid() => pid() | ended},
            %% the sweep timer; its message alone starts a sweep
            sweep :: reference()}).

-spec start_link() -> {ok, pid()} | {error, term()}.
start_link() ->
    gen_server:start_link({local, ?MODULE}, ?MODULE, [], []).

%% @doc Called by a caller before it sends its request to `Process' (a process on
%% another node) tagged with `Alias'. If this process watches `Process', from now
%% until `unwatch/2' the server's `DOWN' reaches the caller as
%% ``{'$convoy_call_down', Alias, Reason}'', and the result is a monitor of this
%% process, whose `DOWN' comes tagged `{?CALLS_GONE, Alias}' (it means nothing
%% more will be passed on; the tag names the alias, so that the caller's receive
%% names it in every clause). Otherwise
%% `unavailable' (convoy is not running, or the server is not watched yet: this
%% process is asked to watch it for later calls): the caller watches the server
%% itself.
-spec watch(pid(), reference()) -> {ok, reference()} | unavailable.
watch(Process, Alias) ->
    case whereis(?MODULE) of
        undefined ->
            unavailable;
        Pid ->
            try ets:member(?WATCHED, Process) of
                true -> join(Pid, Process, Alias);
                false -> not_watched(Pid, Process)
            catch
                error:badarg -> unavailable % the tables went with their owner
            end
    end.

%% Registered first, then looked up again (see the module header).
join(Pid, Process, Alias) ->
    Mon = erlang:monitor(process, Pid, [{tag, {?CALLS_GONE, Alias}}]),
    try
        true = ets:insert(?WAITERS, {Alias, Process, self()}),
        case ets:member(?WATCHED, Process) of
            true ->
                {ok, Mon};
            false ->
                gave_up(Process, Alias, Mon),
                not_watched(Pid, Process)
        end
    catch
        error:badarg ->
            gave_up(Process, Alias, Mon),
            unavailable
    end.

not_watched(Pid, Process) ->
    gen_server:cast(Pid, {watch, Process}),
    unavailable.

gave_up(Process, Alias, Mon) ->
    ok = unwatch(Process, Alias),
    true = erlang:demonitor(Mon, [flush]),
    ok.

%% @doc The call to `Process' tagged `Alias' is over.
-spec unwatch(pid(), reference()) -> ok.
unwatch(Process, Alias) ->
    try ets:delete_object(?WAITERS, {Alias, Process, self()}) of
        true -> ok
    catch
        error:badarg -> ok
    end.

%% @private
-spec init([]) -> {ok, #s{}}.
init([]) ->
    %% Watchers are linked: they end with this process, and their exits come as
    %% messages.
    process_flag(trap_exit, true),
    _ = ets:new(?WATCHED, [named_table, protected, set, {read_concurrency, true}]),
    _ = ets:new(?WAITERS, [named_table, public, set, {write_concurrency, true}]),
    {ok, #s{sweep = sweep_timer()}}.

%% @private
-spec handle_call(term(), {pid(), term()}, #s{}) -> {reply, {error, badarg}, #s{}}.
handle_call(_Other, _From, S) ->
    convoy_metrics:rejected(unknown_message),
    {reply, {error, badarg}, S}.

%% @private
-spec handle_cast(term(), #s{}) -> {noreply, #s{}}.
handle_cast({watch, Process}, S) ->
    case is_remote(Process) of
        true -> {noreply, watched(Process, S)};
        false -> rejected(S)
    end;
handle_cast(_Other, S) ->
    rejected(S).

%% @private
-spec handle_info(term(), #s{}) -> {noreply, #s{}}.
handle_info({?TAG_CALLS_WATCHING, Watcher}, S = #s{servers = Ss}) when is_map_key(Watcher, Ss) ->
    ok = watching(maps:get(Watcher, Ss)),
    {noreply, S};
handle_info({'EXIT', Watcher, Reason}, S = #s{servers = Ss}) when is_map_key(Watcher, Ss) ->
    {noreply, watcher_exit(maps:get(Watcher, Ss), Watcher, Reason, S)};
handle_info({timeout, Timer, sweep}, S = #s{sweep = Timer}) ->
    ok = forget_dead_callers(),
    {noreply, (maps:fold(fun sweep/3, S, S#s.watchers))#s{sweep = sweep_timer()}};
handle_info(_Other, S) ->
    rejected(S).

%% @private
%% A watcher: takes the monitor of Process (this may wait while its node's
%% distribution buffer is full; nobody waits for it), tells Owner, and exits
%% with the server's `DOWN' reason.
-spec watcher(pid(), pid()) -> no_return().
watcher(Process, Owner) ->
    Mon = erlang:monitor(process, Process),
    Owner ! {?TAG_CALLS_WATCHING, self()},
    receive
        {'DOWN', Mon, process, _, Reason} -> exit({?TAG_CALLS_WATCH_DOWN, Reason})
    end.

sweep_timer() ->
    erlang:start_timer(?SWEEP_MS, self(), sweep).

%% The monitor is in place: callers may rely on it from now on.
watching(ended) ->
    ok;
watching(Process) ->
    true = ets:insert(?WATCHED, {Process}),
    ok.

%% A watcher killed by a sweep is gone; one that passes on its server's `DOWN'
%% ends the watch (the entry goes first, see the module header); one killed by
%% anyone else is replaced, and its server stays watched.
watcher_exit(ended, Watcher, _Reason, S = #s{servers = Ss}) ->
    S#s{servers = maps:remove(Watcher, Ss)};
watcher_exit(Process, Watcher, {?TAG_CALLS_WATCH_DOWN, Reason}, S) ->
    true = ets:delete(?WATCHED, Process),
    _ = [Alias ! {?TAG_CALL_DOWN, Alias, Reason} || Alias <- waiters(Process)],
    forget(Process, Watcher, S);
watcher_exit(Process, Watcher, _Killed, S) ->
    start_watcher(Process, forget(Process, Watcher, S)).

%% The aliases of the calls waiting on Process (a scan: only when a monitor ends).
waiters(Process) ->
    ets:select(?WAITERS, [{{'$1', '$2', '_'},
                           [{is_reference, '$1'}, {'=:=', '$2', {const, Process}}], ['$1']}]).

%% Entries of callers that died during their call (killed: nothing else skips
%% unwatch/2).
forget_dead_callers() ->
    Dead = [E || {_, _, Pid} = E <- ets:tab2list(?WAITERS),
                 not (is_pid(Pid) andalso node(Pid) =:= node() andalso is_process_alive(Pid))],
    lists:foreach(fun(E) -> true = ets:delete_object(?WAITERS, E) end, Dead).

rejected(S) ->
    convoy_metrics:rejected(unknown_message),
    {noreply, S}.

is_remote(Pid) when is_pid(Pid) -> node(Pid) =/= node();
is_remote(_) -> false.

watched(Process, S = #s{watchers = Ws}) when is_map_key(Process, Ws) ->
    S;
watched(Process, S) ->
    start_watcher(Process, S).

start_watcher(Process, S = #s{watchers = Ws, servers = Ss}) ->
    Watcher = spawn_link(?MODULE, watcher, [Process, self()]),
    S#s{watchers = Ws#{Process => Watcher}, servers = Ss#{Watcher => Process}}.

%% No caller waits on Process: drop its monitor (kill its watcher). The entry
%% goes first, so a caller registering now either is seen here or asks again
%% (see the module header). A watcher without its monitor yet has no entry.
sweep(Process, Watcher, S = #s{watchers = Ws, servers = Ss}) ->
    Entry = ets:take(?WATCHED, Process),
    case waiters(Process) of
        [] ->
            exit(Watcher, kill),
            S#s{watchers = maps:remove(Process, Ws), servers = Ss#{Watcher := ended}};
        _ ->
            true = ets:insert(?WATCHED, Entry),
            S
    end.

forget(Process, Watcher, S = #s{watchers = Ws, servers = Ss}) ->
    S#s{watchers = maps:remove(Process, Ws), servers = maps:remove(Watcher, Ss)}.
