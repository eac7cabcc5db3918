%% Peer nodes and polling for the Common Test suites, in one place.
%%
%% Peers are driven over stdio (peer:call works whatever happens to distribution,
%% and a disconnect does not stop them) and connected over distribution here; they
%% get convoy's code and the calling suite's.
-module(convoy_ct_peers).

-export([start/3, start_convoy/2, convoy_peer/3, await_route/2, route_kind/1, await/3,
         restart_here/0]).

%% A peer named Name for Suite; Extra: peer:start_options(), `args' appended.
start(Suite, Name, Extra) ->
    Args = ["-pa", filename:dirname(code:which(convoy)),
            "-pa", filename:dirname(code:which(Suite))] ++ maps:get(args, Extra, []),
    Opts = (maps:remove(args, Extra))#{name => Name, args => Args, connection => standard_io},
    {ok, Peer, Node} = test_server:start_peer(Opts, Suite, Name),
    true = net_kernel:connect_node(Node),
    {Peer, Node}.

%% Start convoy on a peer with Settings (application environment).
start_convoy(Peer, Settings) ->
    [ok = peer:call(Peer, application, set_env, [convoy, K, V]) || {K, V} <- maps:to_list(Settings)],
    {ok, _} = peer:call(Peer, application, ensure_all_started, [convoy]),
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

%% convoy started afresh with its defaults on this node (a test case's start).
-spec restart_here() -> ok.
restart_here() ->
    _ = application:stop(convoy),
    {ok, _} = application:ensure_all_started(convoy),
    ok.
