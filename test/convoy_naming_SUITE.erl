%% convoy started before its node has a name (`net_kernel:start/1' after the
%% application started, as a plain `mix test' does), and across a restart of
%% distribution under another name: everything a peer sends to the node's pids,
%% aliases and registered names arrives, exactly, and nothing is rejected
%% (convoy started before the node is named).
%%
%% The node under test is a peer started without a name (driven over stdio, so
%% it stays reachable while it has none); this node sends to it through convoy.
-module(convoy_naming_SUITE).

-include_lib("common_test/include/ct.hrl").
-include_lib("stdlib/include/assert.hrl").

-export([all/0, init_per_testcase/2, end_per_testcase/2]).
-export([started_before_named/1, distribution_restarted/1]).
%% Run on the peer.
-export([collector/1, ask/2]).

-define(SENDS, 8000).

all() ->
    [started_before_named, distribution_restarted].

init_per_testcase(_TC, Config) ->
    _ = application:stop(convoy),
    Config.

end_per_testcase(_TC, _Config) ->
    convoy_ct_peers:stop_local().

%%--------------------------------------------------------------------
%% Cases

%% convoy starts on a node with no name; the node is named; a peer's sends to
%% processes made before and after the naming all arrive.
started_before_named(_Config) ->
    Peer = unnamed_peer(),
    nonode@nohost = peer:call(Peer, erlang, node, []),
    ok = convoy_ct_peers:start_convoy(Peer, #{}),
    Before = collectors(Peer, before),
    Node = name(Peer, ?CT_PEER_NAME(named)),
    After = collectors(Peer, later),
    convoy_ct_peers:start_local(#{}),
    exchange(Peer, Node, Before ++ After).

%% convoy runs on a named node whose distribution is stopped and started again
%% under another name (a new creation): sends to the new name arrive.
distribution_restarted(_Config) ->
    Peer = unnamed_peer(),
    _ = name(Peer, ?CT_PEER_NAME(first)),
    ok = convoy_ct_peers:start_convoy(Peer, #{}),
    Before = collectors(Peer, before),
    ok = peer:call(Peer, net_kernel, stop, []),
    Node = name(Peer, ?CT_PEER_NAME(second)),
    After = collectors(Peer, later),
    convoy_ct_peers:start_local(#{}),
    exchange(Peer, Node, Before ++ After).

%%--------------------------------------------------------------------
%% The exchange

%% This node sends ?SENDS messages to each destination (a pid, an alias and a
%% registered name per collector) through convoy; each collector gets all of
%% them, in order, and the peer rejects nothing.
exchange(Peer, Node, Collectors) ->
    true = convoy_ct_peers:await(fun() -> net_kernel:connect_node(Node) end,
                                 fun(Up) -> Up end, 10000),
    convoy_ct_peers:await_route(Node, convoy),
    convoy_ct_peers:await(fun() -> convoy_ct_peers:route_kind(
                                     peer:call(Peer, convoy_peers, route, [node()])) end,
                          fun(K) -> K =:= convoy end, 10000),
    %% Destinations as the peer hands them out now (a pid it gave out before it
    %% was named is of `nonode@nohost' here).
    Pids = [{peer:call(Peer, erlang, whereis, [Name]), Name} || Name <- Collectors],
    Dests = [{Kind, D} || {Pid, Name} <- Pids,
                          {Kind, D} <- [{pid, Pid}, {alias, ask(Peer, Pid, alias)},
                                        {name, {Name, Node}}]],
    [ok = convoy:send(D, {seq, Kind, I}) || I <- lists:seq(1, ?SENDS), {Kind, D} <- Dests],
    ok = convoy:flush(Node),
    Expected = #{pid => ?SENDS, alias => ?SENDS, name => ?SENDS},
    Got = [counts(Peer, Pid, Expected, erlang:monotonic_time(millisecond) + 10000)
           || {Pid, _} <- Pids],
    Rejected = maps:get(rejected, peer:call(Peer, convoy, info, [])),
    ct:pal("~p: each collector got ~p; rejected there: ~p", [Node, Got, Rejected]),
    ?assertEqual([Expected || _ <- Got], Got),
    ?assertEqual([], [KV || {_, N} = KV <- maps:to_list(Rejected), N > 0]),
    ok.

%% A collector's counts once they are Expected, or as they are at Deadline.
counts(Peer, Pid, Expected, Deadline) ->
    case ask(Peer, Pid, counts) of
        Expected ->
            Expected;
        Counts ->
            case erlang:monotonic_time(millisecond) > Deadline of
                true -> Counts;
                false -> receive after 20 -> counts(Peer, Pid, Expected, Deadline) end
            end
    end.

%% Started without a name; reachable over stdio whatever its distribution does.
unnamed_peer() ->
    Args = ["-pa", filename:dirname(code:which(convoy)),
            "-pa", filename:dirname(code:which(?MODULE))],
    {ok, Peer, nonode@nohost} = peer:start_link(#{connection => standard_io, args => Args}),
    Peer.

name(Peer, Name) ->
    {ok, _} = peer:call(Peer, net_kernel, start, [[list_to_atom(Name), shortnames]]),
    peer:call(Peer, erlang, node, []).

%% Two collectors on the peer, made now; their registered names.
collectors(Peer, Tag) ->
    [begin
         Name = list_to_atom(atom_to_list(Tag) ++ "_" ++ integer_to_list(I)),
         _ = peer:call(Peer, ?MODULE, collector, [Name]),
         Name
     end || I <- [1, 2]].

%% A collector's alias, or its counts.
ask(Peer, Pid, What) ->
    peer:call(Peer, ?MODULE, ask, [Pid, What]).

%%--------------------------------------------------------------------
%% On the peer

%% @private A collector registered as Name, with an alias made now.
collector(Name) ->
    Parent = self(),
    Pid = spawn(fun() ->
                        true = register(Name, self()),
                        Alias = alias(),
                        Parent ! {ready, self()},
                        loop(Alias, #{})
                end),
    receive {ready, Pid} -> Pid end.

%% Per destination kind, how many came; a message out of order stops the count
%% of its kind (it then never reaches what the test expects).
loop(Alias, Counts) ->
    receive
        {ask, From, alias} ->
            From ! {self(), Alias},
            loop(Alias, Counts);
        {ask, From, counts} ->
            From ! {self(), Counts},
            loop(Alias, Counts);
        {seq, Kind, I} ->
            loop(Alias, case maps:get(Kind, Counts, 0) of
                            N when I =:= N + 1 -> Counts#{Kind => I};
                            _ -> Counts#{Kind => disordered}
                        end)
    end.

%% @private Ask a collector (the peer's own call).
ask(C, What) ->
    C ! {ask, self(), What},
    receive {C, Answer} -> Answer after 5000 -> timeout end.
