%% convoy's promises under change, restart and stray input, with peer nodes: no
%% silent loss, no reordering, no crash escalating into the host. Each case
%% reproduces a way convoy once broke them.
-module(convoy_promises_SUITE).

-include_lib("common_test/include/ct.hrl").
-include_lib("stdlib/include/assert.hrl").

-export([all/0, suite/0, init_per_testcase/2, end_per_testcase/2]).
-export([setting_change_while_peer_stalled/1, killed_lane_is_replaced/1,
         stop_mid_flood_keeps_order/1, stop_with_stalled_peer_counts_drops/1,
         killed_under_user_supervisor/1,
         forged_down_to_control/1, stray_lane_messages/1,
         large_multicast_skips_lane/1, killed_while_lanes_slow_to_stop/1,
         large_multicast_through_busy_lane/1, flushes_on_held_lane_then_connect/1]).
%% Run on peer nodes.
-export([collector/0, length_reporter/1, reporter/1]).
%% A logger handler, added by the cases that read convoy's log events.
-export([log/2]).

suite() ->
    [{timetrap, {minutes, 3}}].

all() ->
    [setting_change_while_peer_stalled, killed_lane_is_replaced, stop_mid_flood_keeps_order,
     stop_with_stalled_peer_counts_drops, killed_under_user_supervisor,
     killed_while_lanes_slow_to_stop, forged_down_to_control, stray_lane_messages,
     large_multicast_skips_lane, large_multicast_through_busy_lane,
     flushes_on_held_lane_then_connect].

init_per_testcase(_TC, Config) ->
    _ = application:stop(convoy),
    Config.

end_per_testcase(_TC, _Config) ->
    _ = application:stop(convoy),
    _ = logger:remove_handler(?MODULE),
    ok = logger:unset_module_level(convoy_control),
    %% Gone before the next case starts its own: the user's supervisor stops
    %% convoy's tree, whose lanes may take their shutdown time to drain.
    case whereis(user_sup) of
        undefined ->
            ok;
        Sup ->
            Mon = erlang:monitor(process, Sup),
            exit(Sup, shutdown),
            receive {'DOWN', Mon, process, Sup, _} -> ok
            after 60000 -> ct:fail({user_sup_still_alive, Sup})
            end
    end,
    [application:unset_env(convoy, K) || K <- convoy_config:keys()],
    ok.

%%--------------------------------------------------------------------
%% Helpers

start_convoy(Settings) ->
    [ok = application:set_env(convoy, K, V) || {K, V} <- maps:to_list(Settings)],
    {ok, _} = application:ensure_all_started(convoy),
    ok.

%% collector: per sender, sequence numbers must only go up (gaps are losses,
%% counted by the caller; a number not above the last one is a reordering).
collector() ->
    collector(#{}, 0, 0).

collector(Last, Count, Reordered) ->
    receive
        {seq, From, Seq} ->
            case maps:get(From, Last, 0) of
                Prev when Seq > Prev -> collector(Last#{From => Seq}, Count + 1, Reordered);
                _ -> collector(Last, Count + 1, Reordered + 1)
            end;
        {report, ReplyTo} ->
            ReplyTo ! {report, self(), Count, Reordered},
            collector(Last, Count, Reordered)
    end.

report(C) ->
    C ! {report, self()},
    receive {report, C, Count, Reordered} -> {Count, Reordered}
    after 10000 -> ct:fail({no_report, C})
    end.

%% Senders of N numbered messages each, through convoy:send/2; each reports how
%% many calls returned ok.
start_senders(K, Collector, N) ->
    Self = self(),
    [spawn_link(fun() ->
                        Oks = length([ok || I <- lists:seq(1, N),
                                            ok =:= convoy:send(Collector, {seq, self(), I})]),
                        Self ! {sent, self(), Oks}
                end) || _ <- lists:seq(1, K)].

await_senders(Pids) ->
    lists:sum([receive {sent, P, Oks} -> Oks after 120000 -> ct:fail({sender_stuck, P}) end
               || P <- Pids]).

await_count(Collector, Min) ->
    convoy_ct_peers:await(fun() -> report(Collector) end, fun({C, _}) -> C >= Min end, 30000).

with_stalled(Peer, Fun) ->
    OsPid = peer:call(Peer, os, getpid, []),
    os:cmd("kill -STOP " ++ OsPid),
    try Fun() after os:cmd("kill -CONT " ++ OsPid) end.

lanes() ->
    [P || #{pid := P} <- maps:get(lanes, convoy:info())].

%%--------------------------------------------------------------------
%% Cases

%% Queued entries once carried time 0 when max_delay was 0; raising max_delay then
%% made the lane compute a receive timeout from the (negative) monotonic clock
%% minus 0, crash, and restart convoy with everything it held lost.
setting_change_while_peer_stalled(_Config) ->
    start_convoy(#{}),
    {Peer, Node} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(), #{}),
    Col = spawn(Node, ?MODULE, collector, []),
    {Sup, Control} = {whereis(convoy_sup), whereis(convoy_control)},
    with_stalled(Peer, fun() ->
        ok = convoy:set_config(#{lanes => 2}),
        [ok = convoy:send(Col, {seq, self(), I}) || I <- lists:seq(1, 10)],
        ok = convoy:set_config(#{max_delay => 1000})
    end),
    ok = convoy:flush(Node),
    ?assertEqual({10, 0}, await_count(Col, 10)),
    ?assertEqual({Sup, Control}, {whereis(convoy_sup), whereis(convoy_control)}),
    ?assertMatch(#{lanes := 2, max_delay := 1000}, maps:get(settings, convoy:info())),
    ?assertMatch(#{accepted := A} when A >= 10, maps:get(Node, maps:get(nodes, convoy:info()))).

%% A lane killed under traffic is replaced in place: nothing else restarts, what
%% it held is counted as lost, and nothing is reordered.
killed_lane_is_replaced(_Config) ->
    start_convoy(#{lanes => 2}),
    {_Peer, Node} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(), #{}),
    Col = spawn(Node, ?MODULE, collector, []),
    {Sup, Control} = {whereis(convoy_sup), whereis(convoy_control)},
    [L1, L2] = lanes(),
    Senders = start_senders(4, Col, 20000),
    _ = await_count(Col, 5000),
    exit(L1, kill),
    Sent = await_senders(Senders),
    ok = convoy:flush(),
    #{lost := Lost} = convoy:info(),
    {Received, Reordered} = await_count(Col, Sent - Lost),
    ct:pal("sent ~p received ~p lost ~p", [Sent, Received, Lost]),
    ?assertEqual(80000, Sent),
    ?assertEqual(0, Reordered),
    ?assert(Sent - Received =< Lost),
    ?assertEqual({Sup, Control}, {whereis(convoy_sup), whereis(convoy_control)}),
    [New1, L2] = lanes(),
    ?assert(New1 =/= L1 andalso is_process_alive(New1)),
    %% The replacement works.
    Col2 = spawn(Node, ?MODULE, collector, []),
    [ok = convoy:send(Col2, {seq, self(), I}) || I <- lists:seq(1, 100)],
    ?assertEqual({100, 0}, await_count(Col2, 100)).

%% application:stop/1 in the middle of a flood: what was handed over is shipped,
%% senders go on with plain sends and back to convoy after the restart, and no
%% message is lost or reordered.
stop_mid_flood_keeps_order(_Config) ->
    start_convoy(#{}),
    {_Peer, Node} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(), #{}),
    Col = spawn(Node, ?MODULE, collector, []),
    Senders = start_senders(8, Col, 40000),
    _ = await_count(Col, 30000),
    ok = application:stop(convoy),
    receive after 200 -> ok end, % the scenario: started again 200 ms later
    start_convoy(#{}),
    Sent = await_senders(Senders),
    ?assertEqual(320000, Sent),
    ?assertEqual({Sent, 0}, await_count(Col, Sent)).

%% application:stop/1 while a peer is stalled (SIGSTOP) and convoy holds messages
%% for it: its lane waits on the full distribution buffer, the rest in its
%% mailbox behind. The lane cannot drain, so the stop ends at its own bound (the
%% control's drain time, then the lane is killed); it returns, and before the
%% counters go what could not leave is counted and logged (`convoy_lane_stopped',
%% dropped per node) and the counts are reported (`convoy_stopped'). After SIGCONT
%% every message sent is received or among those counted, and none is reordered.
stop_with_stalled_peer_counts_drops(_Config) ->
    start_convoy(#{bypass_after => never}), % every message through the lane
    {Peer, Node} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(), #{}),
    Col = convoy_ct_seq:start(Node),
    ok = logger:add_handler(?MODULE, ?MODULE, #{level => all, config => #{to => self()}}),
    %% convoy_stopped is at info level when nothing was dropped before the lanes stop.
    ok = logger:set_module_level(convoy_control, info),
    Payload = binary:copy(<<"s">>, 2000),
    OsPid = peer:call(Peer, os, getpid, []),
    _ = os:cmd("kill -STOP " ++ OsPid),
    {Sent, Stop} =
        try
            %% 40 MB: more than the socket buffers take, so the distribution buffer
            %% fills and convoy holds the rest.
            Oks = length([ok || I <- lists:seq(1, 20000),
                                ok =:= convoy:send(Col, {seq, self(), I, Payload})]),
            #{queued := Q} = maps:get(Node, maps:get(nodes, convoy:info())),
            ct:pal("queued in the lane when convoy stops: ~p", [Q]),
            ?assert(Q > 0),
            {Oks, bounded_stop()}
        after
            os:cmd("kill -CONT " ++ OsPid)
        end,
    ?assertEqual(20000, Sent),
    ?assertEqual(ok, Stop),
    LaneStopped = log_event(convoy_lane_stopped),
    Stopped = log_event(convoy_stopped),
    ct:pal("logged: ~p~n~p", [LaneStopped, Stopped]),
    ?assertMatch(#{nodes := #{Node := #{accepted := 20000}}}, Stopped),
    #{dropped := #{Node := Dropped}} = LaneStopped,
    ?assert(Dropped > 0),
    %% Everything that was not counted arrives (what the killed lane was sending
    %% is counted even if part of it had reached the distribution buffer).
    {Received, Errors} = convoy_ct_seq:await(Col, Sent - Dropped),
    ct:pal("sent ~p, received ~p, counted dropped ~p; first gaps ~p",
           [Sent, Received, Dropped, Errors]),
    ?assert(Received + Dropped >= Sent),
    %% Gaps are the dropped messages; a number not above the previous one would be
    %% a reordering.
    ?assertEqual([], [E || {_, Prev, Seq} = E <- Errors, Seq =< Prev]).

%% application:stop(convoy) from a process of its own: convoy_sup gives
%% convoy_control 15 s (its drain is bounded by 10 s) and each lane 5 s, so a stop
%% that has not returned well after their sum is stuck.
bounded_stop() ->
    Self = self(),
    Pid = spawn_link(fun() -> Self ! {stopped, self(), application:stop(convoy)} end),
    receive {stopped, Pid, Result} -> Result
    after 15000 + 5000 + 10000 -> ct:fail(stop_not_bounded)
    end.

%% The first report logged with `what => What' since the handler was added. The
%% lanes and convoy_control have logged before the stop returned; the wait only
%% covers the handler's message being in flight.
log_event(What) ->
    receive {convoy_log, What, Report} -> Report
    after 5000 -> ct:fail({not_logged, What})
    end.

%% Logger handler: forwards convoy's stop reports to the test case.
log(#{msg := {report, #{what := What} = Report}}, #{config := #{to := To}})
  when What =:= convoy_lane_stopped; What =:= convoy_stopped ->
    To ! {convoy_log, What, Report},
    ok;
log(_Event, _Config) ->
    ok.

%% convoy under a user's supervisor (intensity 10): killing convoy's top supervisor
%% mid-flood once made every restart fail on names its dying processes still held,
%% until the user's supervisor gave up. Now it restarts, twice in a row, and
%% nothing is reordered (what the killed lanes could not ship is logged).
killed_under_user_supervisor(_Config) ->
    {ok, UserSup} = convoy_test_sup:start([convoy:child_spec(#{lanes => 2})], 10),
    {_Peer, Node} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(), #{}),
    Col = spawn(Node, ?MODULE, collector, []),
    Senders = start_senders(8, Col, 30000),
    _ = await_count(Col, 20000),
    Old = whereis(convoy_sup),
    exit(Old, kill),
    New = convoy_ct_peers:await(fun() -> whereis(convoy_sup) end,
                                fun(P) -> is_pid(P) andalso P =/= Old end, 30000),
    _ = convoy_ct_peers:await(fun() -> catch convoy_peers:route(Node) end,
                              fun(R) -> is_tuple(R) andalso element(1, R) =:= convoy end, 30000),
    exit(New, kill),
    _ = convoy_ct_peers:await(fun() -> whereis(convoy_sup) end,
                              fun(P) -> is_pid(P) andalso P =/= New end, 30000),
    Sent = await_senders(Senders),
    ?assertEqual(240000, Sent),
    ?assert(is_process_alive(UserSup)),
    ok = convoy:flush(),
    {Received, Reordered} = report(Col),
    ct:pal("sent ~p received ~p", [Sent, Received]),
    ?assertEqual(0, Reordered).

%% The same, made deterministic: the killed tree's lanes cannot stop at once (here
%% they are suspended, as a lane with a long mailbox or a stalled peer is slow to
%% go), so its lane supervisor outlives it for its shutdown time. Every restart
%% once failed at once with {already_started, OldLaneSup}, and the user's
%% supervisor (intensity 10) gave up within milliseconds. Now the new tree waits
%% for the old one's processes: one restart, the user's supervisor survives, and
%% the new convoy ships.
killed_while_lanes_slow_to_stop(_Config) ->
    {ok, UserSup} = convoy_test_sup:start([convoy:child_spec(#{lanes => 2})], 10),
    {_Peer, Node} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(), #{}),
    Old = whereis(convoy_sup),
    OldLaneSup = whereis(convoy_lane_sup),
    [true = erlang:suspend_process(L) || L <- lanes()],
    exit(Old, kill),
    %% Until a new tree runs, or the user's supervisor has given up.
    {Alive, New} = convoy_ct_peers:await(
                     fun() -> {is_process_alive(UserSup), whereis(convoy_sup)} end,
                     fun({A, P}) -> not A orelse (is_pid(P) andalso P =/= Old) end, 60000),
    ?assert(Alive),
    ?assertNot(is_process_alive(OldLaneSup)),
    ?assertEqual([{convoy, New, supervisor, [convoy]}], supervisor:which_children(UserSup)),
    convoy_ct_peers:await_route(Node, convoy),
    Col = spawn(Node, ?MODULE, collector, []),
    [ok = convoy:send(Col, {seq, self(), I}) || I <- lists:seq(1, 100)],
    ?assertEqual({100, 0}, await_count(Col, 100)).

%% A DOWN for a monitor convoy_control does not hold is counted, not obeyed.
forged_down_to_control(_Config) ->
    start_convoy(#{}),
    {_Peer, Node} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(), #{}),
    Control = whereis(convoy_control),
    [Lane] = lanes(),
    #{unknown_message := U0} = maps:get(rejected, convoy:info()),
    convoy_control ! {'DOWN', make_ref(), process, Lane, boom},
    _ = sys:get_state(convoy_control),
    ?assertEqual(Control, whereis(convoy_control)),
    ?assertEqual([Lane], lanes()),
    ?assertMatch(#{unknown_message := U} when U =:= U0 + 1, maps:get(rejected, convoy:info())),
    Col = spawn(Node, ?MODULE, collector, []),
    [ok = convoy:send(Col, {seq, self(), I}) || I <- lists:seq(1, 100)],
    ?assertEqual({100, 0}, await_count(Col, 100)).

%% Control-shaped messages without convoy_control's secret, or with bad fields,
%% are counted; the lane neither crashes nor holds, releases or retires.
stray_lane_messages(_Config) ->
    start_convoy(#{}),
    {_Peer, Node} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(), #{}),
    [Lane] = lanes(),
    #{unknown_message := U0} = maps:get(rejected, convoy:info()),
    Stray = [{'$convoy_hold', not_a_list}, {'$convoy_hold', make_ref(), [Node]},
             {'$convoy_hold', [Node]}, {'$convoy_release', Node},
             {'$convoy_release', make_ref(), Node}, {'$convoy_retire', 5, self()},
             {'$convoy_retire', make_ref(), 5}, {'$convoy_flush', all, not_a_pid, t},
             {'$convoy_flush', "node", self(), t}, {'$convoy_wait', Node, not_a_ref, 1},
             {'$convoy_wait', Node, make_ref(), -1}, {'EXIT', self(), boom},
             {'DOWN', make_ref(), process, self(), boom},
             {'$convoy_sends', not_a_list, 1}, {'$convoy_sends', [], 1},
             {'$convoy_sends', [{'$convoy_send', Node, self(), m, -1}], 1},
             {'$convoy_sends', [{'$convoy_send', Node, self(), m, 1}], 2}],
    [Lane ! M || M <- Stray],
    _ = sys:get_state(Lane),
    ?assertEqual([Lane], lanes()),
    ?assertMatch(#{unknown_message := U} when U =:= U0 + length(Stray),
                 maps:get(rejected, convoy:info())),
    ?assertMatch(#{held := none, retiring := false}, sys:get_state(Lane)),
    Col = spawn(Node, ?MODULE, collector, []),
    [ok = convoy:send(Col, {seq, self(), I}) || I <- lists:seq(1, 100)],
    ok = convoy:flush(Node),
    ?assertEqual({100, 0}, await_count(Col, 100)).

%% A large multicast once went through the lane whatever its size: copied into the
%% lane's heap, which kept it afterwards. With the lane idle, the sender now ships
%% it to the peer's inbox itself (counted as `direct'), and the lane's heap stays
%% small.
large_multicast_skips_lane(_Config) ->
    start_convoy(#{}),
    {_Peer, Node} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(), #{}),
    [Lane] = lanes(),
    R = spawn(Node, ?MODULE, length_reporter, [self()]),
    Big = lists:seq(1, 2000000),
    Direct = direct(Node),
    ok = convoy:multicast([R], Big),
    receive {length, 2000000} -> ok after 30000 -> ct:fail(not_delivered) end,
    ?assertEqual(Direct + 1, direct(Node)),
    _ = sys:get_state(Lane),
    {memory, Memory} = erlang:process_info(Lane, memory),
    ct:pal("lane memory after a ~p-byte multicast: ~p", [erts_debug:flat_size(Big) * 8, Memory]),
    ?assert(Memory < 4 * 1024 * 1024).

%% A large multicast that has to go through the lane (the lane is busy: it holds
%% an earlier message of the sender's) is shipped alone, and its copy in the lane's
%% heap is collected once the lane is idle, not kept. Under `block` the multicast
%% waits for room until the lane has shipped the earlier message (a large message
%% is held within one connection buffer), so its sender is not the process that
%% suspends the lane.
large_multicast_through_busy_lane(_Config) ->
    start_convoy(#{bypass_after => never}),
    {_Peer, Node} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(), #{}),
    [Lane] = lanes(),
    R = spawn(Node, ?MODULE, reporter, [self()]),
    Big = lists:seq(1, 2000000),
    Direct = direct(Node),
    ok = sys:suspend(Lane),
    Self = self(),
    Sender = spawn_link(fun() ->
                                ok = convoy:send(R, first),
                                ok = convoy:multicast([R], Big),
                                Self ! {sent, self()}
                        end),
    timer:sleep(200), % `first' in the lane, the multicast after it
    ok = sys:resume(Lane),
    receive {sent, Sender} -> ok after 30000 -> ct:fail(sender_stuck) end,
    receive {got, first} -> ok after 30000 -> ct:fail(first_not_delivered) end,
    receive {got, {length, 2000000}} -> ok after 30000 -> ct:fail(not_delivered) end,
    ?assertEqual(Direct, direct(Node)), % both went through the lane
    Memory = await_memory_below(Lane, 4 * 1024 * 1024, 50),
    ct:pal("lane memory after a multicast it shipped: ~p", [Memory]),
    ?assert(Memory < 4 * 1024 * 1024).

%% The lane's memory once below Limit, looking every 20 ms, at most Tries times;
%% else its last size.
await_memory_below(Lane, Limit, Tries) ->
    {memory, Memory} = erlang:process_info(Lane, memory),
    case Memory < Limit orelse Tries =< 1 of
        true -> Memory;
        false -> timer:sleep(20), await_memory_below(Lane, Limit, Tries - 1)
    end.

direct(Node) ->
    maps:get(direct, maps:get(Node, maps:get(nodes, convoy:info()), #{}), 0).

%% Reports what it receives: lists by their length.
reporter(To) ->
    receive
        L when is_list(L) -> To ! {got, {length, length(L)}};
        M -> To ! {got, M}
    end,
    reporter(To).

length_reporter(To) ->
    receive L when is_list(L) -> To ! {length, length(L)} end.

%% Flushes waiting on a lane that starts held (a lanes change while the old lanes
%% are slow to go: suspended here), with a message in it for a node that is not
%% connected: when the lane opens, the message leaves once the lane has connected
%% the node, and both flushes are answered. The second flush's mark, pushed while
%% the first one's chunk was out, once restarted the node queue's wait at the
%% time 0: with `max_delay' above 0 and a negative monotonic clock, the message
%% put back behind it never became due.
flushes_on_held_lane_then_connect(_Config) ->
    start_convoy(#{lanes => 2, max_delay => 20000}),
    {Peer, Node} = convoy_ct_peers:start(?MODULE, ?CT_PEER_NAME(), #{}),
    %% A process that keeps what it gets, queried over stdio: a query over
    %% distribution would connect the node itself.
    Holder = peer:call(Peer, erlang, spawn, [timer, sleep, [infinity]]),
    true = erlang:disconnect_node(Node),
    ?assertNot(lists:member(Node, nodes())),
    Old = lanes(),
    [true = erlang:suspend_process(L) || L <- Old],
    ok = convoy:set_config(#{lanes => 1}),
    [New] = lanes(),
    ok = convoy:send(Holder, held_then_connected),
    Self = self(),
    Flushers = [spawn_link(fun() -> Self ! {flushed, self(), convoy:flush(all, 20000)} end)
                || _ <- [1, 2]],
    %% Both flushes reached the new lane, which holds them while it is held.
    convoy_ct_peers:await(
      fun() -> {erlang:process_info(New, message_queue_len),
                [erlang:process_info(F, status) || F <- Flushers]} end,
      fun({{message_queue_len, Q}, Sts}) ->
              Q =:= 0 andalso Sts =:= [{status, waiting}, {status, waiting}]
      end,
      10000),
    ?assertMatch(#{held := all}, sys:get_state(New)),
    [true = erlang:resume_process(L) || L <- Old],
    ?assertEqual([ok, ok], [receive {flushed, F, R} -> R after 30000 -> ct:fail({flush_stuck, F}) end
                            || F <- Flushers]),
    ?assertEqual({message_queue_len, 1},
                 convoy_ct_peers:await(
                   fun() -> peer:call(Peer, erlang, process_info, [Holder, message_queue_len]) end,
                   fun(L) -> L =:= {message_queue_len, 1} end, 10000)),
    ?assertMatch(#{messages := 1, dropped := 0}, maps:get(Node, maps:get(nodes, convoy:info()))).
