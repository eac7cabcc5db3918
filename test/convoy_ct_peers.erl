%% Peer nodes and polling for the Common Test suites, in one place.
%%
%% Peers are driven over stdio (peer:call works whatever happens to distribution,
%% and a disconnect does not stop them) and connected over distribution here; they
%% get convoy's code and the calling suite's.
-module(convoy_ct_peers).

-export([start/3, start_convoy/2, start_local/1, stop_local/0, convoy_peer/3, await_route/2,
         route_kind/1, await/3, with_stopped/2,
         restart_here/0, route_as_version/2, trace_inbox/1, traced/1, sink_on/1, received/2]).
%% This node's lanes (each node's own, `convoy_lanes').
-export([lanes/0, lane/2, slots/1, all_slots/0]).
%% Run on the peers.
-export([sink/0]).

-include_lib("convoy/src/convoy_runtime.hrl").

%% Every lane of every node, node by node.
lanes() ->
    [L || {_Node, #runtime{lanes = Lanes}} <- convoy_runtimes:rows(), L <- tuple_to_list(Lanes)].

%% Lane I of Node's (its pid).
lane(Node, I) ->
    #runtime{lanes = Lanes} = convoy_runtimes:row(Node),
    element(I, Lanes).

%% Node's lanes' admission counters, as a tuple (lane I's at I).
slots(Node) ->
    #runtime{slots = Slots} = convoy_runtimes:row(Node),
    Slots.

%% Every lane's admission counters, node by node.
all_slots() ->
    [S || {_Node, #runtime{slots = Slots}} <- convoy_runtimes:rows(), S <- tuple_to_list(Slots)].

%% A peer named Name for Suite; Extra: peer:start_options(), `args' appended.
start(Suite, Name, Extra) ->
    Args = ["-pa", filename:dirname(code:which(convoy)),
            "-pa", filename:dirname(code:which(Suite))] ++ maps:get(args, Extra, []),
    Opts = (maps:remove(args, Extra))#{name => Name, args => Args, connection => standard_io},
    {ok, Peer, Node} = test_server:start_peer(Opts, Suite, Name),
    %% A connection attempt can fail on a loaded machine (seen once with both
    %% cores busy): try again for a while rather than fail the case.
    true = await(fun() -> net_kernel:connect_node(Node) end, fun(Up) -> Up end, 30000),
    {Peer, Node}.

%% Start convoy on a peer with Settings (application environment).
start_convoy(Peer, Settings) ->
    [ok = peer:call(Peer, application, set_env, [convoy, K, V]) || {K, V} <- maps:to_list(Settings)],
    {ok, _} = peer:call(Peer, application, ensure_all_started, [convoy]),
    ok.

%% Start convoy on this node with Settings (application environment).
start_local(Settings) ->
    [ok = application:set_env(convoy, K, V) || {K, V} <- maps:to_list(Settings)],
    {ok, _} = application:ensure_all_started(convoy),
    ok.

%% Stop convoy on this node and forget every setting (a test case's end).
stop_local() ->
    _ = application:stop(convoy),
    [application:unset_env(convoy, K) || K <- convoy_config:keys()],
    ok.

%% A peer running convoy with Settings, once this node (which must run convoy)
%% routes to it through convoy.
convoy_peer(Suite, Name, Settings) ->
    {Peer, Node} = start(Suite, Name, #{}),
    ok = start_convoy(Peer, Settings),
    await_route(Node, convoy),
    {Peer, Node}.

%% Wait until the local convoy_peers routes to Node as Kind (convoy or plain).
await_route(Node, Kind) ->
    await(fun() -> route_kind(convoy_peers:route(Node)) end, fun(R) -> R =:= Kind end, 10000).

route_kind(plain) -> plain;
route_kind({convoy, _Vsn, _Inboxes}) -> convoy.

%% Poll Get until Ok(Value) (other nodes' state cannot be waited on); fails the
%% test case after Timeout ms. Returns the value.
await(Get, Ok, Timeout) ->
    await_loop(Get, Ok, erlang:monotonic_time(millisecond) + Timeout).

await_loop(Get, Ok, Deadline) ->
    V = Get(),
    case Ok(V) of
        true ->
            V;
        false ->
            case erlang:monotonic_time(millisecond) > Deadline of
                true -> ct:fail({timeout_waiting, V});
                false -> receive after 20 -> await_loop(Get, Ok, Deadline) end
            end
    end.

%% Fun's result, run while Peer's OS process is stopped (SIGSTOP); it runs again
%% (SIGCONT) whatever Fun does.
-spec with_stopped(peer:server_ref(), fun(() -> T)) -> T.
with_stopped(Peer, Fun) ->
    OsPid = peer:call(Peer, os, getpid, []),
    _ = os:cmd("kill -STOP " ++ OsPid),
    try Fun() after os:cmd("kill -CONT " ++ OsPid) end.

%% convoy started afresh with its defaults on this node (a test case's start).
-spec restart_here() -> ok.
restart_here() ->
    _ = application:stop(convoy),
    {ok, _} = application:ensure_all_started(convoy),
    ok.

%% Rewrite Node's route on this node as a convoy peer at protocol version Vsn
%% would have it (convoy_peers is the table's writer: the write runs inside it).
-spec route_as_version(node(), pos_integer()) -> ok.
route_as_version(Node, Vsn) ->
    _ = sys:replace_state(convoy_peers,
                          fun(S) ->
                                  [{Node, {convoy, _, Inboxes}, C, H}] =
                                      ets:lookup(convoy_nodes, Node),
                                  true = ets:insert(convoy_nodes,
                                                    {Node, {convoy, Vsn, Inboxes}, C, H}),
                                  S
                          end),
    ok.

%% Trace the batches the inbox registered as Name receives; returns the tracer.
-spec trace_inbox(atom()) -> pid().
trace_inbox(Name) ->
    Tracer = spawn(fun() -> tracer([]) end),
    1 = erlang:trace(whereis(Name), true, ['receive', {tracer, Tracer}]),
    Tracer.

tracer(Acc) ->
    receive
        {trace, _, 'receive', {'$convoy', _, batch, _, Entries}} -> tracer(lists:reverse(Entries, Acc));
        {trace, _, 'receive', _} -> tracer(Acc);
        {get, From} -> From ! {traced, lists:reverse(Acc)}
    end.

%% The batch entries a tracer saw, in order (`timeout' if it does not answer).
-spec traced(pid()) -> list() | timeout.
traced(Tracer) ->
    Tracer ! {get, self()},
    receive {traced, Entries} -> Entries after 5000 -> timeout end.

%% A process on Node that keeps what it gets, in arrival order (`received/2').
-spec sink_on(node()) -> pid().
sink_on(Node) ->
    spawn(Node, ?MODULE, sink, []).

%% The messages a sink got, once it has N of them (in arrival order).
-spec received(pid(), non_neg_integer()) -> [term()].
received(Sink, N) ->
    await(fun() -> got(Sink) end, fun(Got) -> length(Got) >= N end, 20000).

got(Sink) ->
    Sink ! {get, self()},
    receive {got, Sink, Got} -> Got after 5000 -> ct:fail(sink_silent) end.

-spec sink() -> no_return().
sink() ->
    sink([]).

sink(Acc) ->
    receive
        {get, From} -> From ! {got, self(), lists:reverse(Acc)}, sink(Acc);
        M -> sink([M | Acc])
    end.
