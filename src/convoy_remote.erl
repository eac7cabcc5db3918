%% @private
%% Sends to other nodes, and monitors of processes there, that never suspend the
%% process making them.
%%
%% A send to another node, a monitor of a process there and its demonitor are
%% each a signal on that node's distribution connection. While the connection's
%% buffer is full (the node is stalled or slow to read), the runtime suspends
%% the process that makes one until the buffer drains: for a stopped node, until
%% it runs again or is declared down (`net_ticktime', 60 s by default). A convoy
%% process that serves every node (an inbox, `convoy_peers') must never make
%% one: it would hold up every other node's traffic behind the stalled one.
%%
%% <ul>
%% <li>`send/3' sends with `[nosuspend, noconnect]'. When the connection is busy
%%   the message goes to a courier, a short-lived process that makes the blocking
%%   send (suspended in its place until the connection takes it); while a node has
%%   a courier, later messages to it wait in the outbox and leave, in order, once
%%   the courier is done (`courier_done/3'). So messages to one node leave in the
%%   order they were sent, there is at most one courier per node, and what a
%%   stalled node is owed still reaches it when it resumes. `noconnect' as
%%   before: a node not connected gets nothing, and nothing connects to it.</li>
%% <li>`watch/2' gives the monitor to a watcher, a process that takes it (and may
%%   be suspended doing so), watches the owner too, and exits when the watched
%%   process's `DOWN' comes: the owner's monitor of the watcher, tagged as the
%%   owner asked, then fires with the watched process's exit reason. `unwatch/1'
%%   drops the owner's monitor and kills the watcher: both local signals, and the
%%   runtime removes a dead process's monitors without suspending anyone. A
%%   watcher killed by anyone else ends its watch as the watched process's death
%%   would (reason `killed'): the owner is never left holding a watch that cannot
%%   fire. `convoy_calls' keeps its watchers itself, with the same rule.</li>
%% </ul>
%% A courier ends its owner's entry for its node with the `DOWN' of its monitor,
%% tagged `{?TAG_COURIER, Node}'; the owner hands it to `courier_done/3', which
%% answers `unknown' for any it does not hold.
-module(convoy_remote).

-export([new/0, send/3, courier_done/3, watch/2, unwatch/1]).

-export_type([outbox/0, dest/0, watch/0]).

-include("convoy_tags.hrl").

-define(OPTS, [nosuspend, noconnect]).

%% Per node with a courier at work: the courier's monitor and the messages
%% waiting for it to be done, newest first.
-opaque outbox() :: #{node() => {reference(), [{dest(), term()}]}}.
-type dest() :: pid() | reference() | {atom(), node()}.
%% A watcher and the owner's monitor of it: the monitor's `DOWN' ends the watch.
-type watch() :: {Watcher :: pid(), Mon :: reference()}.

%% @doc An outbox with no courier at work.
-spec new() -> outbox().
new() -> #{}.

%% @doc Send `Msg' to `To' (of another node) without ever suspending the caller.
-spec send(dest(), term(), outbox()) -> outbox().
send(To, Msg, Out) ->
    Node = dest_node(To),
    case Out of
        #{Node := {Mon, Waiting}} ->
            Out#{Node := {Mon, [{To, Msg} | Waiting]}};
        _ ->
            case erlang:send(To, Msg, ?OPTS) of
                nosuspend -> Out#{Node => {courier(Node, [{To, Msg}]), []}};
                _OkOrNoconnect -> Out
            end
    end.

%% @doc The courier for `Node' whose monitor is `Mon' is done (its `DOWN' came):
%% the messages that waited for it are sent, or handed to a new courier from the
%% first the connection does not take at once. `unknown' if no courier of this
%% outbox has that monitor.
-spec courier_done(node(), reference(), outbox()) -> {ok, outbox()} | unknown.
courier_done(Node, Mon, Out) ->
    case Out of
        #{Node := {Mon, Waiting}} -> {ok, flush(Node, lists:reverse(Waiting), maps:remove(Node, Out))};
        _ -> unknown
    end.

flush(_Node, [], Out) ->
    Out;
flush(Node, [{To, Msg} | Rest] = Sends, Out) ->
    case erlang:send(To, Msg, ?OPTS) of
        nosuspend -> Out#{Node => {courier(Node, Sends), []}};
        _OkOrNoconnect -> flush(Node, Rest, Out)
    end.

%% The courier's sends wait out the busy connection; they never connect.
courier(Node, Sends) ->
    {_Pid, Mon} = spawn_opt(fun() -> lists:foreach(fun courier_send/1, Sends) end,
                            [{monitor, [{tag, {?TAG_COURIER, Node}}]}]),
    Mon.

courier_send({To, Msg}) ->
    erlang:send(To, Msg, [noconnect]).

dest_node({_Name, Node}) -> Node;
dest_node(PidOrRef) -> node(PidOrRef).

%% @doc Watch `Process' (a process of another node, or a name there) from a
%% watcher: the caller gets `{Tag, Mon, process, Watcher, Reason}' when it dies
%% (`Reason' its exit reason, `noconnection' when its node goes).
-spec watch(pid() | {atom(), node()}, term()) -> watch().
watch(Process, Tag) ->
    Owner = self(),
    spawn_opt(fun() -> watcher(Process, Owner) end, [{monitor, [{tag, Tag}]}]).

%% @doc End a watch: no `DOWN' of it comes after this returns.
-spec unwatch(watch()) -> ok.
unwatch({Watcher, Mon}) ->
    true = erlang:demonitor(Mon, [flush]),
    true = exit(Watcher, kill),
    ok.

%% May be suspended taking the monitor; exits with the watched process's reason,
%% or when its owner goes.
watcher(Process, Owner) ->
    OwnerMon = erlang:monitor(process, Owner),
    Mon = erlang:monitor(process, Process),
    receive
        {'DOWN', Mon, process, _, Reason} -> exit(Reason);
        {'DOWN', OwnerMon, process, _, _} -> ok
    end.
