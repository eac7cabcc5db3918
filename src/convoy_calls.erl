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
%% Tables (this process owns both; they go with it):
%% <ul>
%% <li>`convoy_call_watched' (protected set): `{Process}' for each server this
%%   process monitors now, read by callers (a server there is watched);</li>
%% <li>`convoy_call_waiters' (public set): `{Alias, Process, Caller}' for each
%%   call in progress, written by the callers themselves (keyed by the call's
%%   alias: a bag keyed by the server made 256 concurrent callers of one server
%%   scan each other's entries on every insert and delete). A caller killed
%%   mid-call cannot remove its entry: each sweep removes those of callers that
%%   are no longer alive.</li>
%% </ul>
%% A server not watched yet: the caller monitors it itself for that call, as
%% gen_server:call does, and asks this process (a cast) to watch it from then on.
%% Taking a monitor is a distribution signal that waits while the node's
%% distribution buffer is full; no caller ever waits for this process to take
%% one, so a busy node delays only the calls to it, as with gen_server:call.
%%
%% Why no caller misses a `DOWN': a caller registers first, then looks for the
%% server in `convoy_call_watched', and relies on the shared monitor only if it
%% is there. This process, when a monitor ends (`DOWN', or the sweep below),
%% first removes the server from `convoy_call_watched', then reads the waiters.
%% A caller that saw the server watched registered before that removal, so it is
%% among the waiters read; one that did not see it monitors the server itself.
%%
%% A call that starts after the server died but before its `DOWN' reached this
%% process exits with the server's exit reason, not `noproc': as a call made just
%% before the death would (gen_server:call's own monitor would say `noproc').
%%
%% Monitors of servers nobody waits on are dropped every `SWEEP_MS' (a server
%% called again is monitored again: one signal per sweep at most), so the number
%% of monitors stays that of servers called lately. A sweep is the message of
%% the one timer this process keeps, `{timeout, Timer, sweep}' with `Timer' in
%% its state: a look-alike from elsewhere cannot start a sweep nor add a timer.
%% The `DOWN' passed on is ``{'$convoy_call_down', Alias, Reason}'' sent to the
%% caller's alias: once the call is over the alias is inactive and the message
%% is dropped by the runtime. A caller also monitors this process during its
%% call: if it goes, the caller monitors the server itself (`convoy_gen').
%%
%% Anything else that reaches this process is counted as rejected
%% (`unknown_message') and changes nothing.
-module(convoy_calls).
-behaviour(gen_server).

-include("convoy_runtime.hrl").

-export([start_link/0, watch/2, unwatch/2]).
-export([init/1, handle_call/3, handle_cast/2, handle_info/2]).

-define(WATCHED, convoy_call_watched).
-define(WAITERS, convoy_call_waiters).
-define(SWEEP_MS, 5000).

-record(s, {monitors = #{} :: #{pid() => reference()},
            refs = #{} :: #{reference() => pid()},
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
%% process is asked to watch it for later calls): the caller monitors the server
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
handle_info({'DOWN', Ref, process, _Object, Reason}, S = #s{refs = Refs})
  when is_map_key(Ref, Refs) ->
    #{Ref := Process} = Refs,
    true = ets:delete(?WATCHED, Process),
    _ = [Alias ! {'$convoy_call_down', Alias, Reason} || Alias <- waiters(Process)],
    {noreply, forget(Process, Ref, S)};
handle_info({timeout, Timer, sweep}, S = #s{sweep = Timer}) ->
    ok = forget_dead_callers(),
    {noreply, (maps:fold(fun sweep/3, S, S#s.monitors))#s{sweep = sweep_timer()}};
handle_info(_Other, S) ->
    rejected(S).

sweep_timer() ->
    erlang:start_timer(?SWEEP_MS, self(), sweep).

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

watched(Process, S = #s{monitors = Ms}) when is_map_key(Process, Ms) ->
    S;
watched(Process, S = #s{monitors = Ms, refs = Refs}) ->
    Ref = erlang:monitor(process, Process),
    true = ets:insert(?WATCHED, {Process}),
    S#s{monitors = Ms#{Process => Ref}, refs = Refs#{Ref => Process}}.

%% No caller waits on Process: drop its monitor. The entry goes first, so a caller
%% registering now either is seen here or asks again (see the module header).
sweep(Process, Ref, S) ->
    true = ets:delete(?WATCHED, Process),
    case waiters(Process) =/= [] of
        true ->
            true = ets:insert(?WATCHED, {Process}),
            S;
        false ->
            erlang:demonitor(Ref, [flush]),
            forget(Process, Ref, S)
    end.

forget(Process, Ref, S = #s{monitors = Ms, refs = Refs}) ->
    S#s{monitors = maps:remove(Process, Ms), refs = maps:remove(Ref, Refs)}.
