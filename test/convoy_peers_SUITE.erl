%% convoy_peers: what this node learns about a peer comes only from that peer's
%% answer to our own request (forged and replayed hellos and welcomes from another
%% node change nothing), forged runtime messages are harmless, rows are written by
%% convoy_peers only, and rows of nodes that are gone are forgotten with their
%% counters kept in a bounded history and logged.
%%
%% Peers: X runs convoy with one inbox and receives real traffic; A runs convoy and
%% is the attacker (it sees X's hello like every node does, so it knows X's
%% convoy_peers pid).
-module(convoy_peers_SUITE).

-include_lib("common_test/include/ct.hrl").
-include_lib("stdlib/include/assert.hrl").

-export([all/0, groups/0, suite/0, init_per_suite/1, end_per_suite/1,
         init_per_group/2, end_per_group/2, init_per_testcase/2, end_per_testcase/2]).
-export([forged_welcome_changes_nothing/1, replayed_hellos_change_nothing/1,
         forged_runtime_messages/1, remote_calls_refused/1, peer_restart_relearnt/1,
         refs_when_not_running/1, table_is_protected/1,
         dead_names_forgotten/1, rows_kept_while_needed/1, gone_peer_forgotten/1,
         direct_count_after_forget/1, kept_refs_after_forget_and_restart/1,
         sent_again_while_old_lanes_retire/1]).
%% Run on peer nodes.
-export([send_then_barrier/2, replay/3]).
%% logger handler
-export([log/2]).

-define(SENDERS, 8).
-define(PER_SENDER, 250).

suite() ->
    [{timetrap, {seconds, 120}}].

all() ->
    [{group, exchange}, {group, api}, {group, sweep}].

groups() ->
    [{exchange, [sequence], [forged_welcome_changes_nothing, replayed_hellos_change_nothing,
                             forged_runtime_messages, remote_calls_refused,
                             peer_restart_relearnt]},
     {api, [], [refs_when_not_running, table_is_protected]},
     {sweep, [], [dead_names_forgotten, rows_kept_while_needed, gone_peer_forgotten,
                  direct_count_after_forget, kept_refs_after_forget_and_restart,
                  sent_again_while_old_lanes_retire]}].

init_per_suite(Config) ->
    Config.

end_per_suite(_Config) ->
    ok.

%% Two lanes here, and every message through a lane (no direct sends), so traffic
%% to X goes through X's inbox whichever lane a sender uses.
init_per_group(exchange, Config) ->
    start_convoy(#{lanes => 2, bypass_after => never}),
    {PeerX, X} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(convoy_x), #{lanes => 1}),
    {PeerA, A} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(convoy_attacker), #{}),
    %% The peer controllers are linked to this (init_per_group) process, which ends.
    unlink(PeerX),
    unlink(PeerA),
    [{peer_x, PeerX}, {x, X}, {peer_a, PeerA}, {a, A} | Config];
init_per_group(_Group, Config) ->
    Config.

end_per_group(exchange, Config) ->
    [catch peer:stop(?config(P, Config)) || P <- [peer_x, peer_a]],
    stop_convoy();
end_per_group(_Group, _Config) ->
    ok.

init_per_testcase(TC, Config) when TC =:= refs_when_not_running; TC =:= table_is_protected;
                                   TC =:= dead_names_forgotten; TC =:= rows_kept_while_needed;
                                   TC =:= gone_peer_forgotten; TC =:= direct_count_after_forget;
                                   TC =:= kept_refs_after_forget_and_restart;
                                   TC =:= sent_again_while_old_lanes_retire ->
    stop_convoy(),
    Config;
init_per_testcase(_TC, Config) ->
    Config.

end_per_testcase(TC, _Config) when TC =:= refs_when_not_running; TC =:= table_is_protected;
                                   TC =:= dead_names_forgotten; TC =:= rows_kept_while_needed;
                                   TC =:= gone_peer_forgotten; TC =:= direct_count_after_forget;
                                   TC =:= kept_refs_after_forget_and_restart;
                                   TC =:= sent_again_while_old_lanes_retire ->
    _ = logger:remove_handler(?MODULE),
    stop_convoy();
end_per_testcase(_TC, _Config) ->
    ok.

start_convoy(Settings) ->
    [ok = application:set_env(convoy, K, V) || {K, V} <- maps:to_list(Settings)],
    {ok, _} = application:ensure_all_started(convoy),
    ok.

stop_convoy() ->
    _ = application:stop(convoy),
    [application:unset_env(convoy, K) || K <- convoy_config:keys()],
    ok.

%%--------------------------------------------------------------------
%% The exchange

%% A welcome claiming X with 1024 inboxes (X runs one), sent by A with X's real
%% convoy_peers pid, used to become X's route: lanes shipped to inboxes X does not
%% have and every message was lost while counted as sent. Now it is rejected as
%% unsolicited and traffic to X arrives complete and in order.
forged_welcome_changes_nothing(Config) ->
    X = ?config(x, Config),
    Route = convoy_peers:route(X),
    ?assertEqual({convoy, convoy_wire:version(), {convoy_inbox_1}}, Route),
    XPeers = erpc:call(X, erlang, whereis, [convoy_peers]),
    Forged = #{versions => [1], node => X, peers => XPeers, inboxes => 1024},
    XRef = erpc:call(X, erlang, make_ref, []),
    Msgs = [{'$convoy', 1, welcome, Forged},
            {'$convoy', 1, welcome, Forged#{request => make_ref()}},
            {'$convoy', 1, welcome, Forged#{request => XRef}},
            %% a hello is never learnt from either, whatever it claims
            {'$convoy', 1, hello, Forged},
            {'$convoy', 1, hello, Forged#{request => XRef}}],
    Before = rejected(),
    attack(Config, Msgs),
    ?assertEqual(Route, convoy_peers:route(X)),
    traffic_to(X),
    ?assertEqual((zero())#{unsolicited => 3}, delta(Before, rejected())).

%% X's hello replayed 3,000 times by A (with X's pid and request, and with other
%% pids of X, which make this node ask X itself) used to flip X's route to plain
%% and back each time, reordering traffic. Now convoy_peers writes nothing to the
%% table while they arrive and traffic during the replay stays in order.
replayed_hellos_change_nothing(Config) ->
    X = ?config(x, Config),
    Route = convoy_peers:route(X),
    XPeers = erpc:call(X, erlang, whereis, [convoy_peers]),
    Hello = #{versions => [1], node => X, peers => XPeers, inboxes => 1,
              request => erpc:call(X, erlang, make_ref, [])},
    OtherPid = erpc:call(X, erlang, spawn, [fun() -> ok end]), % dead, but a pid of X
    %% Senders send directly when their lane is idle and quiet, as by default, and
    %% pause between messages so that it often is: one sent through an inbox can
    %% then be overtaken by a later direct one while the route reads plain.
    ok = convoy:set_config(#{bypass_after => 20}),
    Writes = trace_writes(whereis(convoy_peers)),
    Watcher = spawn_link(fun() -> watch_route(X, Route, 0) end),
    Collector = convoy_ct_seq:start(X),
    Senders = start_senders(Collector, 20 * ?PER_SENDER, 30),
    Before = rejected(),
    ok = peer:call(?config(peer_a, Config), ?MODULE, replay,
                   [{convoy_peers, node()}, [{'$convoy', 1, hello, Hello},
                                             {'$convoy', 1, hello, Hello#{peers := OtherPid}},
                                             {'$convoy', 1, hello, maps:remove(request, Hello)}],
                    1000], 60000),
    await_senders(Senders),
    Seq = convoy_ct_seq:await(Collector, ?SENDERS * 20 * ?PER_SENDER),
    Watcher ! {stop, self()},
    Changes = receive {route_changes, _} = R -> R after 5000 -> timeout end,
    Written = stop_trace(Writes),
    ok = convoy:set_config(#{bypass_after => never}),
    ct:pal("order: ~p~nroute seen changed: ~p~ntable writes: ~p", [Seq, Changes, length(Written)]),
    ?assertEqual({?SENDERS * 20 * ?PER_SENDER, []}, Seq),
    ?assertEqual({route_changes, 0}, Changes),
    ?assertEqual([], Written),
    ?assertEqual(zero(), delta(Before, rejected())),
    ?assertEqual(Route, convoy_peers:route(X)),
    ?assertMatch(#{dropped := 0, buffered := 0}, node_stats(X)).

%% DOWN, nodeup, nodedown and timer messages anyone can send: no route changes,
%% nothing restarts; those that cannot be real are counted.
forged_runtime_messages(Config) ->
    X = ?config(x, Config),
    Route = convoy_peers:route(X),
    Peers = whereis(convoy_peers),
    XPeers = erpc:call(X, erlang, whereis, [convoy_peers]),
    Before = rejected(),
    attack(Config, [{'DOWN', make_ref(), process, XPeers, normal},
                    {'DOWN', make_ref(), process, {convoy_peers, X}, noproc},
                    {nodedown, X, []}, % X is connected: not acted on
                    {nodeup, X, []},   % asks X again: its answer changes nothing
                    {nodeup, 123, []},
                    {timeout, make_ref(), tick},
                    {'$convoy', 1, batch, X, []},
                    stray]),
    ?assertEqual((zero())#{unknown_message := 6}, delta(Before, rejected())),
    ?assertEqual(Route, convoy_peers:route(X)),
    ?assertEqual(Peers, whereis(convoy_peers)),
    traffic_to(X).

%% Only processes on this node may ask convoy_peers to create rows or change the
%% sweep; other nodes get {error, unknown_call}, counted.
remote_calls_refused(Config) ->
    Ghost = list_to_atom("convoy_peers_ghost@" ++ host()),
    Before = rejected(),
    Calls = [{refs, Ghost}, {set_sweep, #{interval => 1, grace => 0}}, sweep, forgotten],
    ?assertEqual([{error, unknown_call} || _ <- Calls],
                 [peer:call(?config(peer_a, Config), gen_server, call,
                            [{convoy_peers, node()}, C]) || C <- Calls]),
    ?assertEqual((zero())#{unknown_message := length(Calls)}, delta(Before, rejected())),
    ?assertEqual(none, convoy_peers:lookup(Ghost)).

%% X's convoy restarts: X goes plain, then is learnt again from X's answer.
peer_restart_relearnt(Config) ->
    X = ?config(x, Config),
    PeerX = ?config(peer_x, Config),
    ok = peer:call(PeerX, application, stop, [convoy]),
    convoy_ct_peers:await_route(X, plain),
    {ok, _} = peer:call(PeerX, application, ensure_all_started, [convoy]),
    convoy_ct_peers:await_route(X, convoy),
    ?assertEqual([X], [N || N <- convoy_peers:convoy_nodes(), N =:= X]),
    traffic_to(X).

%%--------------------------------------------------------------------
%% Reading and writing the table

%% convoy_peers:refs/1 is called from users' processes: it never raises.
refs_when_not_running(_Config) ->
    ?assertEqual(undefined, whereis(convoy_peers)),
    ?assertEqual(undefined, convoy_peers:refs('nobody@nohost')),
    ?assertEqual(none, convoy_peers:lookup('nobody@nohost')),
    ?assertEqual(plain, convoy_peers:route('nobody@nohost')),
    ?assertEqual([], convoy_peers:convoy_nodes()),
    ?assertEqual([], convoy_peers:all()),
    ?assertMatch(#{running := false, forgotten := #{nodes := 0}}, convoy:info()),
    start_convoy(#{}),
    {C, H} = convoy_peers:refs('nobody@nohost'),
    ?assertEqual({plain, C, H}, convoy_peers:lookup('nobody@nohost')),
    ?assertEqual({C, H}, convoy_peers:refs('nobody@nohost')),
    %% A killed tree: the caller still gets an answer, not an exception.
    exit(whereis(convoy_sup), kill),
    convoy_ct_peers:await(fun() -> whereis(convoy_peers) end, fun(P) -> P =:= undefined end, 5000),
    ?assertEqual(undefined, convoy_peers:refs('other@nohost')).

table_is_protected(_Config) ->
    start_convoy(#{}),
    ?assertEqual(protected, ets:info(convoy_nodes, protection)),
    ?assertEqual(whereis(convoy_peers), ets:info(convoy_nodes, owner)),
    ?assertError(badarg, ets:insert(convoy_nodes, {'x@nohost', plain, a, b})),
    %% rows are created for any process through the call
    Self = self(),
    spawn_link(fun() -> Self ! {refs, convoy_peers:refs('x@nohost')} end),
    receive {refs, {_, _}} -> ok after 5000 -> ct:fail(no_refs) end,
    ?assertMatch({plain, _, _}, convoy_peers:lookup('x@nohost')).

%%--------------------------------------------------------------------
%% Forgetting nodes

%% Sends to many distinct dead node names used to leave one row each, forever.
%% Now the sweep forgets them: the table ends with no row for them, their counts
%% are in the history (info/0) and in the log, in few reports.
dead_names_forgotten(_Config) ->
    N = 3000,
    start_convoy(#{}),
    capture_log(),
    Names = [list_to_atom("convoy_dead_" ++ integer_to_list(I) ++ "@" ++ host())
             || I <- lists:seq(1, N)],
    {C1, H1} = convoy_peers:refs(hd(Names)), % a cached holder
    Self = self(),
    Sender = spawn_link(fun() ->
                                [ok = convoy:send({nobody, Name}, hi) || Name <- Names],
                                ok = convoy:flush(),
                                Self ! sent,
                                %% again, with the refs it cached before the sweep
                                receive again -> ok end,
                                ok = convoy:send({nobody, hd(Names)}, hi),
                                ok = convoy:flush(),
                                Self ! sent
                        end),
    receive sent -> ok after 60000 -> ct:fail(sends_stuck) end,
    ?assert(length(convoy_peers:all()) >= N),
    %% each node has a lane of its own, which keeps nothing once it holds nothing
    Lanes = [P || #{pid := P} <- maps:get(lanes, convoy:info())],
    ?assert(length(Lanes) >= N),
    [?assertMatch(#{known_nodes := K} when K =< 1, sys:get_state(Lane)) || Lane <- Lanes],
    ok = convoy_peers:set_sweep(#{interval => 200, grace => 300}),
    convoy_ct_peers:await(fun() -> maps:get(nodes, convoy_peers:forgotten()) end,
                          fun(F) -> F >= N end, 20000),
    ?assertEqual([], [Name || Name <- Names, convoy_peers:lookup(Name) =/= none]),
    ?assert(length(convoy_peers:all()) =< length(nodes(connected))),
    %% the cached holder sees the row closed, its held array and its counters
    ?assert(convoy_held:is_closed(H1)),
    ?assertEqual(closed, convoy_metrics:add_direct(C1)),
    #{forgotten := #{nodes := Forgotten, totals := Totals, last := Last}, nodes := Nodes} =
        convoy:info(),
    ?assertEqual(N, Forgotten),
    ?assertMatch(#{accepted := N, dropped := N, messages := 0}, Totals),
    ?assertEqual(16, length(Last)),
    [?assertMatch(#{node := _, at := _, counters := #{accepted := 1, dropped := 1}}, L)
     || L <- Last],
    ?assertEqual([], [Name || Name <- Names, is_map_key(Name, Nodes)]),
    %% and their lanes retired: only connected nodes keep theirs
    convoy_ct_peers:await(fun() -> [P || P <- Lanes, is_process_alive(P)] end,
                          fun(Alive) -> length(Alive) =< length(nodes(connected)) end, 20000),
    ?assertEqual([], [N1 || #{node := N1} <- maps:get(lanes, convoy:info()),
                            lists:member(N1, Names)]),
    Reports = log_reports(),
    ct:pal("~p sweep reports: ~p", [length(Reports), [maps:without([nodes], R) || R <- Reports]]),
    ?assertEqual(N, lists:sum([C || #{count := C} <- Reports])),
    ?assertEqual(N, lists:sum([A || #{totals := #{accepted := A}} <- Reports])),
    ?assert(length(Reports) =< 10),
    [?assert(map_size(Named) =< 16) || #{nodes := Named} <- Reports],
    %% a sender holding the forgotten row's refs counts in a fresh row
    Sender ! again,
    receive sent -> ok after 60000 -> ct:fail(sends_stuck) end,
    {_, C2, H2} = convoy_peers:lookup(hd(Names)),
    ?assertEqual({0, 0}, convoy_held:read(H2)),
    ?assertMatch(#{accepted := 1, dropped := 1}, convoy_metrics:node_counts(C2)).

%% Rows of connected nodes, rows holding messages and rows whose counters move
%% are kept, however long the sweep runs.
rows_kept_while_needed(_Config) ->
    start_convoy(#{}),
    {_Peer, Y} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(), #{}),
    ok = convoy_peers:set_sweep(#{interval => 3600000, grace => 0}),
    Held = list_to_atom("convoy_held@" ++ host()),
    Busy = list_to_atom("convoy_busy@" ++ host()),
    Idle = list_to_atom("convoy_idle@" ++ host()),
    {_, H} = convoy_peers:refs(Held),
    {CB, _} = convoy_peers:refs(Busy),
    _ = convoy_peers:refs(Idle),
    ok = convoy_held:hold(H, 100, infinity, infinity),
    Sweeps = [begin
                  convoy_metrics:add(CB, dropped, 1),
                  convoy_peers:sweep()
              end || _ <- lists:seq(1, 5)],
    ?assertEqual([0, 1, 0, 0, 0], Sweeps), % Idle: seen once, then forgotten
    ?assertEqual(none, convoy_peers:lookup(Idle)),
    ?assertMatch({{convoy, _, _}, _, _}, convoy_peers:lookup(Y)),
    ?assertMatch({plain, _, H}, convoy_peers:lookup(Held)),
    ?assertMatch({plain, CB, _}, convoy_peers:lookup(Busy)),
    ?assertEqual({1, 100}, convoy_held:read(H)), % never left closed
    ?assertNot(convoy_held:is_closed(H)),
    %% Once released and quiet, they go too.
    ok = convoy_held:release(H, 1, 100),
    ?assertEqual([2, 0], [convoy_peers:sweep() || _ <- [1, 2]]),
    ?assertEqual([Y], [N || {N, _} <- convoy_peers:all()]),
    ?assertMatch(#{nodes := 3}, convoy_peers:forgotten()).

%% A peer that goes away is forgotten after the grace, its final counters kept.
gone_peer_forgotten(_Config) ->
    start_convoy(#{}),
    {Peer, Y} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(), #{}),
    Collector = convoy_ct_seq:start(Y),
    await_senders(start_senders(Collector, 10)),
    ?assertEqual({?SENDERS * 10, []}, convoy_ct_seq:await(Collector, ?SENDERS * 10)),
    ok = convoy_peers:set_sweep(#{interval => 3600000, grace => 0}),
    ?assertEqual(0, convoy_peers:sweep()), % connected: kept
    peer:stop(Peer),
    convoy_ct_peers:await(fun() -> lists:member(Y, nodes(connected)) end,
                          fun(C) -> not C end, 10000),
    convoy_ct_peers:await_route(Y, plain),
    ?assertEqual([0, 1], [convoy_peers:sweep() || _ <- [1, 2]]),
    ?assertEqual(none, convoy_peers:lookup(Y)),
    #{forgotten := #{nodes := 1, last := [#{node := Y, counters := Cs}]}} = convoy:info(),
    ?assertMatch(#{accepted := A, messages := A, dropped := 0} when A =:= ?SENDERS * 10, Cs).

%% A sender whose cached row was forgotten while its node was gone counts its
%% direct sends in the node's new row once the node is back (the forgotten row's
%% counters are marked: convoy_metrics:add_direct/1).
direct_count_after_forget(_Config) ->
    start_convoy(#{}),
    Name = ?CT_PEER_NAME(),
    {Peer, Y} = convoy_ct_peers:convoy_peer(?MODULE, Name, #{}),
    convoy_ct_peers:await_route(Y, convoy),
    Self = self(),
    Sender = spawn_link(fun Loop() ->
                                receive send -> ok = convoy:send({nobody, Y}, hi) end,
                                Self ! {sent, convoy_sender:is_marked(Y)},
                                Loop()
                        end),
    Sender ! send,
    receive {sent, Marked1} -> ?assertNot(Marked1) after 10000 -> ct:fail(stuck) end,
    ?assertMatch(#{direct := 1, accepted := 1}, node_stats(Y)),
    ok = convoy_peers:set_sweep(#{interval => 3600000, grace => 0}),
    peer:stop(Peer),
    convoy_ct_peers:await(fun() -> lists:member(Y, nodes(connected)) end,
                          fun(C) -> not C end, 10000),
    ?assertEqual([0, 1], [convoy_peers:sweep() || _ <- [1, 2]]),
    ?assertEqual(none, convoy_peers:lookup(Y)),
    {Peer2, Y} = convoy_ct_peers:convoy_peer(?MODULE, Name, #{}),
    convoy_ct_peers:await_route(Y, convoy),
    Sender ! send,
    receive {sent, Marked2} -> ?assertNot(Marked2) after 10000 -> ct:fail(stuck) end,
    ?assertMatch(#{direct := 1, accepted := 1}, node_stats(Y)),
    unlink(Sender),
    exit(Sender, kill),
    peer:stop(Peer2).

%% A marked sender keeps its node's row (`convoy_sender:held_refs/2'): once the row is
%% forgotten (closed) it reads the new one, and once convoy is started again it
%% reads the new instance's. Every message is counted in the row of its time and
%% delivered, and nothing stays held.
kept_refs_after_forget_and_restart(_Config) ->
    Settings = #{max_delay => 1}, % every message through the lane: the sender is marked
    start_convoy(Settings),
    Name = ?CT_PEER_NAME(),
    {Peer, Y} = convoy_ct_peers:convoy_peer(?MODULE, Name, #{}),
    convoy_ct_peers:await_route(Y, convoy),
    Self = self(),
    Sender = spawn_link(fun Loop() ->
                                receive
                                    {burst, To, N} ->
                                        [ok = convoy:send(To, {seq, self(), I}) || I <- lists:seq(1, N)],
                                        ok = convoy:flush(),
                                        #{refs := #{Y := {_Lanes, C, H}}} = convoy_sender:parts(),
                                        Self ! {sent, convoy_sender:is_marked(Y), {C, H}}
                                end,
                                Loop()
                        end),
    Burst = fun(N) ->
                    Collector = convoy_ct_seq:start(Y),
                    Sender ! {burst, Collector, N},
                    receive
                        {sent, Marked, Kept} ->
                            ?assert(Marked),
                            ?assertEqual(convoy_peers:refs(Y), Kept),
                            {_C, H} = Kept,
                            ?assert(convoy_held:is_empty(H)),
                            ?assertMatch({N, []}, convoy_ct_seq:await(Collector, N))
                    after 20000 -> ct:fail(stuck)
                    end
            end,
    Burst(100),
    ?assertMatch(#{accepted := 100, dropped := 0}, node_stats(Y)),
    ok = convoy_peers:set_sweep(#{interval => 3600000, grace => 0}),
    peer:stop(Peer),
    convoy_ct_peers:await(fun() -> lists:member(Y, nodes(connected)) end,
                          fun(C) -> not C end, 10000),
    ?assertEqual([0, 1], [convoy_peers:sweep() || _ <- [1, 2]]),
    {Peer2, Y} = convoy_ct_peers:convoy_peer(?MODULE, Name, #{}),
    convoy_ct_peers:await_route(Y, convoy),
    Burst(100), % the kept row was closed: the new one
    ?assertMatch(#{accepted := 100, dropped := 0}, node_stats(Y)),
    stop_convoy(),
    start_convoy(Settings),
    convoy_ct_peers:await_route(Y, convoy),
    Burst(100), % convoy started again: its rows
    ?assertMatch(#{accepted := 100, dropped := 0}, node_stats(Y)),
    unlink(Sender),
    exit(Sender, kill),
    peer:stop(Peer2).

%%--------------------------------------------------------------------
%% Helpers

host() ->
    tl(lists:dropwhile(fun(C) -> C =/= $@ end, atom_to_list(node()))).

%% A node forgotten while its lane is kept from retiring (suspended), then sent
%% to again: its new lane holds the message until the old one is gone, then
%% ships it (here: counts it dropped, the node does not exist).
sent_again_while_old_lanes_retire(_Config) ->
    start_convoy(#{}),
    X = list_to_atom("convoy_dead_again@" ++ host()),
    LanesOf = fun() -> [P || #{node := N, pid := P} <- maps:get(lanes, convoy:info()), N =:= X] end,
    ok = convoy:send({nobody, X}, one),
    ok = convoy:flush(X), % counted dropped: nothing is held for X
    [Old] = LanesOf(),
    ok = sys:suspend(Old),
    ok = convoy_peers:set_sweep(#{interval => 100, grace => 100}),
    convoy_ct_peers:await(LanesOf, fun(Ls) -> Ls =:= [] end, 20000),
    ok = convoy:send({nobody, X}, two),
    [New] = LanesOf(),
    ?assertNotEqual(Old, New),
    ?assertMatch(#{held := #{X := true}, buffered := 1}, sys:get_state(New)),
    ok = sys:resume(Old),
    convoy_ct_peers:await(fun() -> is_process_alive(Old) end, fun(Alive) -> not Alive end,
                          10000),
    convoy_ct_peers:await(fun() -> sys:get_state(New) end,
                          fun(#{held := H, buffered := B}) ->
                                  B =:= 0 andalso not (is_map(H) andalso is_map_key(X, H))
                          end, 10000),
    ok = convoy:flush(X),
    ?assertMatch(#{accepted := 1, dropped := 1},
                 maps:get(X, maps:get(nodes, convoy:info()))).

rejected() -> maps:get(rejected, convoy:info()).

zero() -> maps:map(fun(_, _) -> 0 end, rejected()).

delta(Before, After) ->
    maps:map(fun(K, V) -> V - maps:get(K, Before, 0) end, After).

node_stats(Node) ->
    maps:get(Node, maps:get(nodes, convoy:info())).

%% Messages from A to this node's convoy_peers, all handled when this returns.
attack(Config, Msgs) ->
    ok = peer:call(?config(peer_a, Config), ?MODULE, send_then_barrier,
                   [{convoy_peers, node()}, Msgs]).

%% Traffic from several senders here to a collector on Node: complete, in order,
%% and counted as what it is.
traffic_to(Node) ->
    Before = node_stats(Node),
    Collector = convoy_ct_seq:start(Node),
    await_senders(start_senders(Collector, ?PER_SENDER)),
    Total = ?SENDERS * ?PER_SENDER,
    ?assertEqual({Total, []}, convoy_ct_seq:await(Collector, Total)),
    After = node_stats(Node),
    ?assertEqual({Total, Total, 0},
                 {maps:get(accepted, After) - maps:get(accepted, Before),
                  maps:get(messages, After) - maps:get(messages, Before),
                  maps:get(dropped, After) - maps:get(dropped, Before)}).

start_senders(Collector, N) ->
    start_senders(Collector, N, 0).

%% Gap: microseconds between a sender's messages (spent computing, not waiting).
start_senders(Collector, N, Gap) ->
    Self = self(),
    [spawn_link(fun() ->
                        [begin
                             ok = convoy:send(Collector, {seq, self(), I}),
                             spin(erlang:monotonic_time(microsecond) + Gap)
                         end || I <- lists:seq(1, N)],
                        ok = convoy:flush(),
                        Self ! {sent, self()}
                end) || _ <- lists:seq(1, ?SENDERS)].

spin(Until) ->
    case erlang:monotonic_time(microsecond) >= Until of
        true -> ok;
        false -> spin(Until)
    end.

await_senders(Pids) ->
    [receive {sent, P} -> ok after 60000 -> ct:fail({sender_stuck, P}) end || P <- Pids],
    ok.

%% Calls of convoy_peers that write to the table, while traced.
trace_writes(Pid) ->
    Tracer = spawn_link(fun() -> tracer([]) end),
    1 = erlang:trace(Pid, true, [call, {tracer, Tracer}]),
    [1 = erlang:trace_pattern({ets, F, A}, true, [global])
     || {F, A} <- [{insert, 2}, {insert_new, 2}, {update_element, 3}, {delete, 2}]],
    {Pid, Tracer}.

stop_trace({Pid, Tracer}) ->
    _ = erlang:trace(Pid, false, [call]),
    _ = erlang:trace_pattern({ets, '_', '_'}, false, [global]),
    Tracer ! {stop, self()},
    receive {writes, W} -> W after 5000 -> ct:fail(tracer) end.

tracer(Acc) ->
    receive
        {trace, _, call, {ets, F, [convoy_nodes | Args]}} -> tracer([{F, Args} | Acc]);
        {trace, _, call, _} -> tracer(Acc);
        {stop, From} -> From ! {writes, lists:reverse(Acc)}
    end.

%% Reads X's route as fast as it can; reports how often it saw another one.
watch_route(Node, Route, Changes) ->
    receive
        {stop, From} -> From ! {route_changes, Changes}
    after 0 ->
        case convoy_peers:route(Node) of
            Route -> watch_route(Node, Route, Changes);
            _ -> watch_route(Node, Route, Changes + 1)
        end
    end.

capture_log() ->
    Self = self(),
    ok = logger:add_handler(?MODULE, ?MODULE, #{config => #{pid => Self}, level => all}),
    %% The report is a notice: make sure the primary level lets it through.
    case logger:compare_levels(maps:get(level, logger:get_primary_config()), notice) of
        gt -> ok = logger:set_primary_config(level, notice);
        _ -> ok
    end.

log(#{msg := {report, #{what := convoy_nodes_forgotten} = R}}, #{config := #{pid := Pid}}) ->
    Pid ! {forgotten_report, R};
log(_Event, _Config) ->
    ok.

log_reports() ->
    receive {forgotten_report, R} -> [R | log_reports()] after 0 -> [] end.

%%--------------------------------------------------------------------
%% Run on peer nodes

send_then_barrier(To, Msgs) ->
    [To ! M || M <- Msgs],
    _ = sys:get_state(To, 10000),
    ok.

replay(To, Msgs, Times) ->
    [[To ! M || M <- Msgs] || _ <- lists:seq(1, Times)],
    _ = sys:get_state(To, 30000),
    ok.
