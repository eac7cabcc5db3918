%% convoy's own tags and user data, with peer nodes: a process
%% registered under one of convoy's tags is sent to like any other, and a
%% multicast that names one process twice (a name and its pid, a pid and its
%% alias) delivers to it in the order a loop of `!' would.
-module(convoy_tags_SUITE).

-include_lib("common_test/include/ct.hrl").
-include_lib("stdlib/include/assert.hrl").

-export([all/0, suite/0, init_per_testcase/2, end_per_testcase/2]).
-export([mark_named_destination/1, multicast_one_process_twice/1,
         multicast_run_one_process_twice/1]).
%% Run on peer nodes.
-export([collector/0, collector_with_alias/1]).

suite() ->
    [{timetrap, {seconds, 120}}].

all() ->
    [mark_named_destination, multicast_one_process_twice, multicast_run_one_process_twice].

init_per_testcase(_TC, Config) ->
    _ = application:stop(convoy),
    Config.

end_per_testcase(_TC, _Config) ->
    convoy_ct_peers:stop_local().

%%--------------------------------------------------------------------
%% Helpers

%% A receiver: records what it gets, in order.
-spec collector() -> no_return().
collector() -> collector([]).

%% A receiver that first makes an alias of itself and tells Parent.
-spec collector_with_alias(pid()) -> no_return().
collector_with_alias(Parent) ->
    Parent ! {alias, self(), alias()},
    collector([]).

collector(Acc) ->
    receive
        {'$get', From} ->
            From ! {'$got', self(), lists:reverse(Acc)},
            collector(Acc);
        M ->
            collector([M | Acc])
    end.

got(Pid) ->
    Pid ! {'$get', self()},
    receive {'$got', Pid, Msgs} -> Msgs after 10000 -> ct:fail({collector_silent, Pid}) end.

%% Wait until Pid has N messages; returns them.
await_got(Pid, N) ->
    convoy_ct_peers:await(fun() -> got(Pid) end, fun(M) -> length(M) >= N end, 30000).

node_stats(Node) ->
    maps:get(Node, maps:get(nodes, convoy:info())).

lane_pids() ->
    [Pid || #{pid := Pid} <- maps:get(lanes, convoy:info())].

%%--------------------------------------------------------------------
%% Cases

%% A process registered as '$convoy_mark' on a peer, sent to through the lane
%% with a flush behind it (max_delay keeps the message queued until the flush's
%% mark joins it): it gets its message, the other traffic of the lane is all
%% delivered, and the lane is still the same process with nothing held or lost.
%% Before the fix the message passed for the flush's mark and the lane crashed.
mark_named_destination(_Config) ->
    ok = convoy_ct_peers:start_local(#{max_delay => 1000}),
    {_PeerB, B} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(tags_mark), #{}),
    Target = spawn(B, ?MODULE, collector, []),
    true = erpc:call(B, erlang, register, ['$convoy_mark', Target]),
    Other = spawn(B, ?MODULE, collector, []),
    Lanes = lane_pids(),
    N = 2000,
    [ok = convoy:send(Other, {m, I}) || I <- lists:seq(1, N)],
    ok = convoy:send({'$convoy_mark', B}, hello),
    ok = convoy:flush(B),
    ?assertEqual([hello], await_got(Target, 1)),
    ?assertEqual([{m, I} || I <- lists:seq(1, N)], await_got(Other, N)),
    ?assertEqual(Lanes, lane_pids()),
    ?assertEqual(0, maps:get(lost, convoy:info())),
    ?assertMatch(#{queued := 0, queued_bytes := 0, dropped := 0}, node_stats(B)).

%% 2,000 multicasts naming one process twice, through convoy as it runs (default
%% settings): a name and the pid it is registered to, a pid and an alias of it.
%% Each receiver gets exactly what a loop of `!' gives it, in that order.
multicast_one_process_twice(_Config) ->
    ok = convoy_ct_peers:start_local(#{}),
    {_PeerB, B} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(tags_multi), #{}),
    {P, Q, P2, Alias} = receivers(B, tags_multi_p),
    N = 2000,
    [ok = convoy:multicast([{tags_multi_p, B}, P, Q], {m, I}) || I <- lists:seq(1, N)],
    [ok = convoy:multicast([P2, Alias], {a, I}) || I <- lists:seq(1, N)],
    Twice = fun(Tag) -> lists:append([[{Tag, I}, {Tag, I}] || I <- lists:seq(1, N)]) end,
    ?assertEqual(Twice(m), await_got(P, 2 * N)),
    ?assertEqual([{m, I} || I <- lists:seq(1, N)], await_got(Q, N)),
    ?assertEqual(Twice(a), await_got(P2, 2 * N)).

%% The same in batches made here, so that runs of equal entries reach the inbox
%% whatever the timing: a run over distinct pids still goes destination by
%% destination, any other entry by entry.
multicast_run_one_process_twice(_Config) ->
    ok = convoy_ct_peers:start_local(#{}),
    {_PeerB, B} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(tags_run), #{}),
    {P, Q, P2, Alias} = receivers(B, tags_run_p),
    Run = fun(Tos, Tag) -> [{Tos, {Tag, I}} || I <- lists:seq(1, 5)] end,
    {convoy_inbox_1, B} ! convoy_wire:batch(node(), Run([tags_run_p, P, Q], m)
                                                     ++ Run([P2, Alias], a)
                                                     ++ Run([P, Q], d)),
    Twice = fun(Tag) -> lists:append([[{Tag, I}, {Tag, I}] || I <- lists:seq(1, 5)]) end,
    Once = fun(Tag) -> [{Tag, I} || I <- lists:seq(1, 5)] end,
    ?assertEqual(Twice(m) ++ Once(d), await_got(P, 15)),
    ?assertEqual(Once(m) ++ Once(d), await_got(Q, 10)),
    ?assertEqual(Twice(a), await_got(P2, 10)).

%% On B: P registered as Name, Q, and P2 with an alias of its own.
receivers(B, Name) ->
    P = spawn(B, ?MODULE, collector, []),
    true = erpc:call(B, erlang, register, [Name, P]),
    Q = spawn(B, ?MODULE, collector, []),
    P2 = spawn(B, ?MODULE, collector_with_alias, [self()]),
    Alias = receive {alias, P2, A} -> A after 10000 -> ct:fail(no_alias) end,
    {P, Q, P2, Alias}.
