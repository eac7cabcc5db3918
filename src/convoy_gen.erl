%% @private
%% `convoy:cast/2' and `convoy:call/2,3': `gen_server:cast/2' and
%% `gen_server:call/2,3' whose request travels through convoy (`convoy_route', the
%% same path as the caller's `convoy:send/2' to that node). Runs in the caller.
%%
%% What the server sees is what gen_server sends: ``{'$gen_cast', Request}'' and
%% ``{'$gen_call', {Caller, Tag}, Request}'', so any gen_server (or GenServer)
%% handles them unchanged and answers a call as usual (`{reply, ...}' or
%% `gen_server:reply/2'); the answer comes back to the caller as the server sends
%% it, not through convoy.
%%
%% A call keeps what OTP 25's `gen' gives for a server on another node, with one
%% change of means. `gen' monitors the server for each call (a monitor and a
%% demonitor signal beside the request) and tags the request with the monitor's
%% alias. Here the request is tagged `[alias | Alias]' with an alias of the
%% call's own, and a server called by pid (global and via names are resolved
%% to one at each call) is watched by one monitor shared by every caller on this
%% node (`convoy_calls'), so many concurrent calls to a server cost a request and
%% a reply each, not four signals. A `{Name, Node}' is monitored per call, as
%% `gen' does: its holder may change, and a monitor resolves the name once. The
%% alias is deactivated when the call returns or times out, so an answer that
%% comes late is dropped by the runtime instead of landing in the caller's
%% mailbox. The monitor gives the exits: `noproc' (no such process or name),
%% `{nodedown, Node}' (connection lost: a `noconnection' DOWN), the server's exit
%% reason, and `timeout' (without `convoy_calls', the call has a monitor of its
%% own, as `gen' does, see below); global and via names whose process is on a node that
%% went down give `noproc', as `gen' does. Exits are
%% `{Reason, {gen_server, call, Args}}' with gen_server's own `Args'. Everything
%% that does not go to another node through a running convoy (a server on this
%% node, convoy not running here, a name that resolves to no remote process, a
%% malformed reference or timeout) is handed to `gen_server:call' itself, so its
%% replies and exits are gen_server's by construction.
%%
%% The caller takes and drops no remote monitor itself: each is a distribution
%% signal, which suspends its sender while the node's distribution buffer is
%% full (a stalled node: until it is declared down), and that would hold the
%% call past its Timeout, as it holds gen_server:call. A call's own monitor
%% (a `{Name, Node}', a server not shared yet, or `convoy_calls' gone) belongs
%% to a watcher process spawned for the call (`watcher/3'): not linked, it
%% monitors the caller too, so it never outlives it; it says
%% ``{'$convoy_call_watching', Alias}'' once its monitor is taken and relays the
%% server's `DOWN' as ``{'$convoy_call_down', Alias, Reason}'', the shape
%% `convoy_calls' passes on; it is killed when the call ends (a local signal:
%% the runtime drops a dead process's monitors without suspending anyone). The
%% caller sends its request only once the monitor is taken, as gen does (a
%% server that dies handling it gives its exit reason, not `noproc'), and waits
%% for that no longer than its Timeout: then the request goes anyway and the
%% call ends in `timeout'. Whatever reached the alias before it was deactivated
%% is taken out of the mailbox.
%%
%% Why routing the request through convoy is safe: a call is one message to the
%% server plus a monitor, and the message is an ordinary convoy send (order kept
%% with the caller's other convoy traffic to that node, nothing lost without a
%% count). The monitor does not depend on the route: if the request is still
%% held by convoy when the node goes, the monitor still fires. One difference is
%% deliberate: where `!' would suspend the caller on a full distribution buffer,
%% convoy's bound for the node (`max_buffered') applies; a call waits for room
%% within its own Timeout whatever the `overload' policy (the caller waits for an
%% answer anyway), so convoy's bound never holds a call past its Timeout, and a
%% request that finds no room in time ends in `timeout' (counted in `refused').
%% A cast is a `convoy:send/2' and follows the `overload' setting.
-module(convoy_gen).

-export([cast/2, call/2, call/3]).
-export([watcher/3]).

-include("convoy_runtime.hrl").
-include("convoy_tags.hrl").
-include("convoy_limits.hrl").

%% gen_server:call/2's timeout (gen's ?default_timeout).
-define(DEFAULT_TIMEOUT, 5000).

-dialyzer({no_improper_lists, [do_call/3, await_own/3, late_reply/1]}).

%% @doc See `convoy:cast/2'.
-spec cast(convoy:server_ref(), term()) -> ok.
cast(Pid, Request) when is_pid(Pid), node(Pid) =/= node() ->
    %% a server on another node by pid, the usual cast: nothing to catch
    convoy_route:send_remote(node(Pid), Pid, {'$gen_cast', Request});
cast({global, Name} = Ref, Request) ->
    cast_registered(Ref, fun() -> global:whereis_name(Name) end, Request);
cast({via, Mod, Name} = Ref, Request) ->
    cast_registered(Ref, fun() -> Mod:whereis_name(Name) end, Request);
cast({Name, Node} = Dest, Request) when is_atom(Name), is_atom(Node) ->
    send(Dest, {'$gen_cast', Request});
cast(Dest, Request) when is_atom(Dest); is_pid(Dest) ->
    send(Dest, {'$gen_cast', Request});
cast(Ref, Request) ->
    %% Malformed: gen_server:cast raises its function_clause.
    gen_server:cast(Ref, Request).

%% A registered process gets the cast through convoy; a name nobody holds (or a
%% registry that fails) is gen_server:cast's to deal with (it ignores the
%% failure, or lets the via module's own send/2 do what it does).
cast_registered(Ref, Where, Request) ->
    case where(Where) of
        Pid when is_pid(Pid) -> send(Pid, {'$gen_cast', Request});
        _ -> gen_server:cast(Ref, Request)
    end.

%% As gen_server's do_send/2: a local name nobody holds is not an error.
send(Dest, Msg) ->
    try convoy_route:send(Dest, Msg)
    catch
        error:badarg -> ok
    end.

%% @doc See `convoy:call/2'.
-spec call(convoy:server_ref(), term()) -> term().
call(ServerRef, Request) ->
    case target(ServerRef, ?DEFAULT_TIMEOUT) of
        gen -> gen_server:call(ServerRef, Request);
        Target -> result(do_call(Target, Request, ?DEFAULT_TIMEOUT), [ServerRef, Request])
    end.

%% @doc See `convoy:call/3'.
-spec call(convoy:server_ref(), term(), timeout()) -> term().
call(ServerRef, Request, Timeout) ->
    case target(ServerRef, Timeout) of
        gen -> gen_server:call(ServerRef, Request, Timeout);
        Target -> result(do_call(Target, Request, Timeout), [ServerRef, Request, Timeout])
    end.

result({ok, Reply}, _Args) -> Reply;
result({exit, Reason}, Args) -> exit({Reason, {gen_server, call, Args}}).

%% Where a call goes through convoy: `{Process, How}', Process a pid or
%% `{Name, Node}' on another node, How `registered' for global and via names (a
%% lost node is then `noproc', as in gen's do_for_proc); `gen' when
%% gen_server:call does it all (see the module header).
target(Ref, Timeout) when Timeout =:= infinity;
                          is_integer(Timeout), Timeout >= 0, Timeout =< ?MAX_RECEIVE_MS ->
    case persistent_term:get(?RUNTIME_KEY, undefined) of
        undefined -> gen;
        _ -> target(Ref)
    end;
target(_Ref, _Timeout) ->
    gen.

target(Pid) when is_pid(Pid) ->
    remote(Pid, direct);
target({global, Name}) ->
    remote(where(fun() -> global:whereis_name(Name) end), registered);
target({via, Mod, Name}) ->
    remote(where(fun() -> Mod:whereis_name(Name) end), registered);
target({Name, Node} = Process) when is_atom(Name), is_atom(Node), Node =/= node(),
                                    node() =/= nonode@nohost ->
    {Process, direct};
target(_) ->
    gen.

remote(Pid, How) when is_pid(Pid), node(Pid) =/= node() -> {Pid, How};
remote(_, _How) -> gen.

%% A registry's answer; a registry that fails is left to gen_server to fail
%% in (it calls the same function again and exits as it does).
where(Fun) ->
    try Fun()
    catch
        _:_ -> undefined
    end.

%% gen's do_call for a remote process, the request sent through convoy. The
%% reply's alias is made here and every clause of the receive below names it,
%% so the compiler has that receive skip what was in the caller's mailbox before
%% the call, as gen_server:call's receive does: a caller with a long queue does
%% not scan it on every call. (The watchers' messages carry the alias for the
%% same reason; the receives of the functions given the alias skip it too.)
do_call({Process, How}, Request, Timeout) ->
    Deadline = deadline(Timeout),
    Alias = erlang:alias([explicit_unalias]),
    Watch0 = watch(Process, Alias),
    ok = watching(Watch0, Alias, Deadline),
    Msg = {'$gen_call', {self(), [alias | Alias]}, Request},
    {Outcome, Watch} =
        case request(Process, Msg, Alias, Deadline) of
            sent ->
                receive
                    {[alias | Alias], Reply} ->
                        {{ok, Reply}, Watch0};
                    {?TAG_CALL_DOWN, Alias, Reason} ->
                        {{exit, down(Reason, Process)}, Watch0};
                    {{?CALLS_GONE, Alias}, _, process, _, _} ->
                        %% convoy_calls is gone (and with it the shared monitor):
                        %% the call watches the server itself from now on
                        %% (`noproc' if the server died in between, whatever its
                        %% reason).
                        Own = own_watch(Process, Alias),
                        {await_own(Alias, Process, Deadline), Own}
                after left(Deadline) ->
                    {late_reply(Alias), Watch0}
                end;
            {exit, _} = Exit ->
                {Exit, Watch0}
        end,
    _ = erlang:unalias(Alias),
    unwatch(Process, Alias, Watch),
    ok = flush_watch(Alias),
    case {How, Outcome} of
        {registered, {exit, {nodedown, _}}} -> {exit, noproc};
        _ -> Outcome
    end.

%% How the call learns that the server is gone: from the monitor convoy_calls
%% shares among callers (`shared': no monitor signal per call), or from a
%% watcher of the call's own (`own') when the server is not shared yet or
%% convoy_calls is not there; either passes the `DOWN' on as
%% ``{'$convoy_call_down', Alias, Reason}''. The reply comes to the alias either
%% way, inactive once the call is over.
%% A `{Name, Node}' always gets its own: the name may have changed hands since a
%% shared monitor resolved it, and only a monitor taken now watches its holder.
watch(Pid, Alias) when is_pid(Pid) ->
    case convoy_calls:watch(Pid, Alias) of
        {ok, Helper} -> {shared, Helper};
        unavailable -> own_watch(Pid, Alias)
    end;
watch(Name, Alias) ->
    own_watch(Name, Alias).

%% The spawn is here, not behind one more local function given the alias: the
%% compiler would then drop the mark that lets do_call/3's receive skip the queue.
own_watch(Process, Alias) ->
    {own, spawn(?MODULE, watcher, [Process, Alias, self()])}.

%% The request goes once the call's own watcher has its monitor (or the call's
%% time is up).
watching({own, _Watcher}, Alias, Deadline) ->
    receive
        {?TAG_CALL_WATCHING, Alias} -> ok
    after left(Deadline) ->
        ok
    end;
watching({shared, _Helper}, _Alias, _Deadline) ->
    ok.

%% @private
%% A call's watcher (see the module header): monitors Process for Caller's call
%% tagged Alias, and relays the server's `DOWN'; it ends with the caller.
-spec watcher(pid() | {atom(), node()}, reference(), pid()) -> ok.
watcher(Process, Alias, Caller) ->
    CallerMon = erlang:monitor(process, Caller),
    Mon = erlang:monitor(process, Process),
    Alias ! {?TAG_CALL_WATCHING, Alias},
    receive
        {'DOWN', Mon, process, _, Reason} ->
            Alias ! {?TAG_CALL_DOWN, Alias, Reason},
            ok;
        {'DOWN', CallerMon, process, _, _} ->
            ok
    end.

%% Nothing of the watch is left: the call's own watcher is killed (no signal
%% to the server's node from the caller), a shared watch's entry removed.
unwatch(_Process, _Alias, {own, Watcher}) ->
    exit(Watcher, kill),
    ok;
unwatch(Pid, Alias, {shared, Helper}) ->
    ok = convoy_calls:unwatch(Pid, Alias),
    erlang:demonitor(Helper, [flush]),
    ok.

%% After the alias is deactivated: what a watcher sent it before is taken out.
flush_watch(Alias) ->
    receive
        {?TAG_CALL_WATCHING, Alias} -> flush_watch(Alias);
        {?TAG_CALL_DOWN, Alias, _} -> flush_watch(Alias)
    after 0 ->
        ok
    end.

%% Hand the request to convoy. If the node's bound is reached, wait for room no
%% longer than the call may last (the caller waits for the answer anyway); a
%% request refused with time left is tried again unless the server is gone.
request(Process, Msg, Alias, Deadline) ->
    Wait = min(left(Deadline), ?MAX_BLOCK_MS),
    case convoy_route:send(Process, Msg, #{overload => block, block_timeout => Wait}) of
        ok ->
            sent;
        {error, overload} ->
            case gone(Alias, Process) of
                {exit, _} = Exit ->
                    Exit;
                no ->
                    case left(Deadline) of
                        0 -> sent; % the wait for the answer times out at once
                        _ -> request(Process, Msg, Alias, Deadline)
                    end
            end
    end.

gone(Alias, Process) ->
    receive
        {?TAG_CALL_DOWN, Alias, Reason} -> {exit, down(Reason, Process)}
    after 0 -> no
    end.

%% After convoy_calls went mid-call, with the call's own monitor of the server
%% (rare: this receive scans the mailbox as any receive does).
await_own(Alias, Process, Deadline) ->
    receive
        {[alias | Alias], Reply} ->
            {ok, Reply};
        {?TAG_CALL_DOWN, Alias, Reason} ->
            {exit, down(Reason, Process)}
    after left(Deadline) ->
        late_reply(Alias)
    end.

%% The wait is over: once the alias is inactive only an answer already in the
%% mailbox can be there.
late_reply(Tag) ->
    _ = erlang:unalias(Tag),
    receive
        {[alias | Tag], Reply} -> {ok, Reply}
    after 0 ->
        {exit, timeout}
    end.

down(noconnection, Process) -> {nodedown, node_of(Process)};
down(Reason, _Process) -> Reason.

node_of({_Name, Node}) -> Node;
node_of(Pid) -> node(Pid).

%% Timeout counts from the start of the call, time spent waiting for room in
%% convoy included.
deadline(infinity) -> infinity;
deadline(Timeout) -> erlang:monotonic_time(millisecond) + Timeout.

left(infinity) -> infinity;
left(Deadline) -> max(0, Deadline - erlang:monotonic_time(millisecond)).
