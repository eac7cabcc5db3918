%% `convoy:send_many/1': what sending the messages one by one with `send/2'
%% gives (order per sender and receiver, bounds and overload, fallbacks, errors),
%% with the small messages for a node handed to the lane at once, or sent as one
%% batch to the peer's inbox when the lane is idle.
-module(convoy_send_many_SUITE).

-include_lib("common_test/include/ct.hrl").
-include_lib("stdlib/include/assert.hrl").
-include("../src/convoy_runtime.hrl").

-export([all/0, suite/0, init_per_testcase/2, end_per_testcase/2]).
-export([order_with_sends/1, one_hand_over/1, idle_lane_one_batch/1, bound_one_by_one/1,
         large_among_small/1, idle_lane_over_max_batch/1,
         bad_destination_sends_nothing/1, not_running_sends_plainly/1,
         lanes_change_keeps_order/1]).
%% Run on peer nodes.
-export([collector/0]).

suite() ->
    [{timetrap, {minutes, 3}}].

all() ->
    [order_with_sends, one_hand_over, idle_lane_one_batch, idle_lane_over_max_batch,
     bound_one_by_one, large_among_small,
     bad_destination_sends_nothing, not_running_sends_plainly, lanes_change_keeps_order].

init_per_testcase(_TC, Config) ->
    _ = application:stop(convoy),
    Config.

end_per_testcase(_TC, _Config) ->
    convoy_ct_peers:stop_local().

%% Senders mix send/2 and send_many/1 to receivers on two nodes and here: every
%% receiver gets each sender's messages once, in order, and every message is
%% accounted for.
order_with_sends(_Config) ->
    convoy_ct_peers:start_local(#{lanes => 2}),
    {_PB, B} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(many_b), #{}),
    {_PC, C} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(many_c), #{}),
    Receivers = [spawn(B, ?MODULE, collector, []), spawn(B, ?MODULE, collector, []),
                 spawn(C, ?MODULE, collector, []), spawn(?MODULE, collector, [])],
    Self = self(),
    N = 3000,
    Senders = [spawn_link(fun() -> Self ! {done, self(), mixed_sender(S, Receivers, N)} end)
               || S <- lists:seq(1, 4)],
    Sent = [receive {done, P, Counts} -> Counts after 60000 -> ct:fail(sender_stuck) end
            || P <- Senders],
    ok = convoy:flush(),
    [begin
         Expected = lists:sum([maps:get(R, Counts) || Counts <- Sent]),
         ?assertEqual({Expected, 0, 0}, await_count(R, Expected))
     end || R <- Receivers],
    Nodes = maps:get(nodes, convoy:info()),
    [?assertMatch(#{accepted := A, messages := A, dropped := 0, buffered := 0},
                  maps:get(Node, Nodes)) || Node <- [B, C]].

%% Each sender numbers its messages per receiver and sends N of them in random
%% runs: one by one, or in lists that mix receivers. Returns how many each
%% receiver was sent.
mixed_sender(S, Receivers, N) ->
    rand:seed(exsss, {S, 7, 11}),
    mixed_sender(S, Receivers, maps:from_list([{R, 0} || R <- Receivers]), N).

mixed_sender(_S, _Receivers, Next, 0) ->
    Next;
mixed_sender(S, Receivers, Next, Left) ->
    K = min(Left, rand:uniform(120)),
    {Msgs, Next1} = lists:mapfoldl(
                      fun(_, Acc) ->
                              R = lists:nth(rand:uniform(length(Receivers)), Receivers),
                              I = maps:get(R, Acc) + 1,
                              {{R, {seq, {self(), S}, I}}, Acc#{R := I}}
                      end, Next, lists:seq(1, K)),
    case rand:uniform(3) of
        1 -> [ok = convoy:send(R, M) || {R, M} <- Msgs];
        _ -> ok = convoy:send_many(Msgs)
    end,
    mixed_sender(S, Receivers, Next1, Left - K).

%% With the lane held (suspended) and batching forced, a send_many of messages
%% for one node reaches the lane as one message, and their room is taken at once.
one_hand_over(_Config) ->
    convoy_ct_peers:start_local(#{bypass_after => never}),
    {_PB, B} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(many_b), #{}),
    Col = spawn(B, ?MODULE, collector, []),
    ok = convoy:send_many([{Col, {seq, self(), 1}}]),
    ok = convoy:flush(),
    [Lane] = lanes(),
    true = erlang:suspend_process(Lane),
    {message_queue_len, Q0} = process_info(Lane, message_queue_len),
    ok = convoy:send_many([{Col, {seq, self(), I}} || I <- lists:seq(2, 101)]),
    {message_queue_len, Q1} = process_info(Lane, message_queue_len),
    ?assertEqual(1, Q1 - Q0),
    ?assertMatch(#{queued := 100}, maps:get(B, maps:get(nodes, convoy:info()))),
    true = erlang:resume_process(Lane),
    ok = convoy:flush(),
    ?assertEqual({101, 0, 0}, await_count(Col, 101)).

%% On an idle lane (held, but holding nothing) a send_many's messages for a
%% node go to the peer's inbox as one batch, the lane's mailbox untouched and
%% the node's bound not taken, counted direct; they keep their order with the
%% sender's messages before and after them, whatever path those take.
idle_lane_one_batch(_Config) ->
    convoy_ct_peers:start_local(#{}),
    {_PB, B} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(many_b), #{}),
    Col = spawn(B, ?MODULE, collector, []),
    ok = convoy:send(Col, {seq, self(), 1}),
    ok = convoy:flush(),
    [Lane] = lanes(),
    #{direct := D0} = maps:get(B, maps:get(nodes, convoy:info())),
    true = erlang:suspend_process(Lane),
    {message_queue_len, Q0} = process_info(Lane, message_queue_len),
    ok = convoy:send_many([{Col, {seq, self(), I}} || I <- lists:seq(2, 101)]),
    {message_queue_len, Q1} = process_info(Lane, message_queue_len),
    ?assertEqual(Q0, Q1),
    ?assertMatch(#{queued := 0}, maps:get(B, maps:get(nodes, convoy:info()))),
    ?assertEqual({101, 0, 0}, await_count(Col, 101)),
    #{direct := D1} = maps:get(B, maps:get(nodes, convoy:info())),
    ?assertEqual(100, D1 - D0),
    %% the sender went through the inbox: its next messages keep their place
    ?assert(convoy_sender:is_marked(B)),
    true = erlang:resume_process(Lane),
    [ok = convoy:send(Col, {seq, self(), I}) || I <- lists:seq(102, 150)],
    ok = convoy:send_many([{Col, {seq, self(), I}} || I <- lists:seq(151, 200)]),
    ok = convoy:flush(),
    ?assertEqual({200, 0, 0}, await_count(Col, 200)),
    ?assertEqual(lists:seq(1, 200), received(Col)).

%% On an idle lane, a node with more messages than `max_batch' is not sent to
%% the inbox: after the other node's batch went there, it is admitted again and
%% handed to the lane at once, in order.
idle_lane_over_max_batch(_Config) ->
    convoy_ct_peers:start_local(#{max_batch => 50}),
    {_PB, B} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(many_b), #{}),
    {_PC, C} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(many_c), #{}),
    ColB = spawn(B, ?MODULE, collector, []),
    ColC = spawn(C, ?MODULE, collector, []),
    ok = convoy:flush(),
    Counts = fun(N) -> maps:with([accepted, direct], maps:get(N, maps:get(nodes, convoy:info())))
             end,
    #{accepted := AB0, direct := DB0} = Counts(B),
    #{accepted := AC0, direct := DC0} = Counts(C),
    ok = convoy:send_many([{ColB, {seq, self(), I}} || I <- lists:seq(1, 120)]
                          ++ [{ColC, {seq, self(), I}} || I <- lists:seq(1, 30)]),
    ok = convoy:flush(),
    ?assertEqual({120, 0, 0}, await_count(ColB, 120)),
    ?assertEqual({30, 0, 0}, await_count(ColC, 30)),
    ?assertEqual(lists:seq(1, 120), received(ColB)),
    #{accepted := AB1, direct := DB1} = Counts(B),
    #{accepted := AC1, direct := DC1} = Counts(C),
    ?assertEqual({120, 0}, {AB1 - AB0, DB1 - DB0}), % through the lane
    ?assertEqual({30, 30}, {AC1 - AC0, DC1 - DC0}),  % one batch to the inbox
    %% every lane (each node's own) disposed of all it admitted
    [?assertEqual(convoy_slots:admitted(S), convoy_slots:disposed(S))
     || {_Node, #runtime{slots = Slots}} <- convoy_runtimes:rows(), S <- tuple_to_list(Slots)].

%% Over the node's bound, send_many drops exactly what sends one by one would
%% drop (the first messages that fit go, the rest are counted as dropped), and
%% keeps order. Batching is forced so that every message takes the lane.
bound_one_by_one(_Config) ->
    convoy_ct_peers:start_local(#{max_buffered => 10, overload => drop, bypass_after => never}),
    {_PB, B} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(many_b), #{}),
    Col = spawn(B, ?MODULE, collector, []),
    ok = convoy:send(Col, {seq, self(), 1}),
    ok = convoy:flush(),
    [Lane] = lanes(),
    true = erlang:suspend_process(Lane),
    ok = convoy:send_many([{Col, {seq, self(), I}} || I <- lists:seq(2, 26)]),
    ?assertMatch(#{queued := 10, dropped := 15}, maps:get(B, maps:get(nodes, convoy:info()))),
    true = erlang:resume_process(Lane),
    ok = convoy:flush(),
    ?assertEqual({11, 0, 0}, await_count(Col, 11)),
    ?assertEqual(lists:seq(1, 11), received(Col)),
    ?assertMatch(#{accepted := 26, messages := 11, dropped := 15},
                 maps:get(B, maps:get(nodes, convoy:info()))).

%% A large message among small ones for the same receiver keeps its place.
large_among_small(_Config) ->
    convoy_ct_peers:start_local(#{large_threshold => 1000}),
    {_PB, B} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(many_b), #{}),
    Col = spawn(B, ?MODULE, collector, []),
    Big = binary:copy(<<"L">>, 5000),
    Msgs = [{Col, {seq, self(), I, case I rem 5 of 0 -> Big; _ -> small end}}
            || I <- lists:seq(1, 50)],
    ok = convoy:send_many(Msgs),
    ok = convoy:flush(),
    ?assertEqual({50, 0, 0}, await_count(Col, 50)),
    ?assertEqual(lists:seq(1, 50), received(Col)).

%% Everything is checked first: a bad destination or an unregistered local name
%% raises badarg with nothing sent; `{Name, node()}' not registered is skipped.
bad_destination_sends_nothing(_Config) ->
    convoy_ct_peers:start_local(#{}),
    {_PB, B} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(many_b), #{}),
    Col = spawn(B, ?MODULE, collector, []),
    Here = spawn(?MODULE, collector, []),
    Good = [{Col, {seq, self(), 1}}, {Here, {seq, self(), 1}}],
    ?assertError(badarg, convoy:send_many(Good ++ [{"not a destination", x}])),
    ?assertError(badarg, convoy:send_many(Good ++ [{no_such_name_here, x}])),
    ?assertError(badarg, convoy:send_many(Good ++ [not_a_pair])),
    ?assertError(badarg, convoy:send_many([{Col, x} | improper])),
    ?assertError(badarg, convoy:send_many(not_a_list)),
    ok = convoy:send_many([]),
    ok = convoy:flush(),
    ?assertEqual([], received(Col)),
    ?assertEqual([], received(Here)),
    ok = convoy:send_many([{{no_such_name_here, node()}, x} | Good]),
    ok = convoy:flush(),
    ?assertEqual({1, 0, 0}, await_count(Col, 1)),
    ?assertEqual({1, 0, 0}, await_count(Here, 1)).

%% convoy not running: plain sends.
not_running_sends_plainly(_Config) ->
    {PeerB, B} = convoy_ct_peers:start(?MODULE, ?CT_PEER_NAME(many_b), #{}),
    ok = convoy_ct_peers:start_convoy(PeerB, #{}),
    Col = spawn(B, ?MODULE, collector, []),
    ok = convoy:send_many([{Col, {seq, self(), I}} || I <- lists:seq(1, 100)]),
    ?assertEqual({100, 0, 0}, await_count(Col, 100)).

%% lanes changes between two send_many calls of a sender: order holds.
lanes_change_keeps_order(_Config) ->
    convoy_ct_peers:start_local(#{lanes => 1}),
    {_PB, B} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(many_b), #{lanes => 4}),
    Col = spawn(B, ?MODULE, collector, []),
    Self = self(),
    Sender = spawn_link(fun() ->
                                [ok = convoy:send_many([{Col, {seq, Self, J}}
                                                        || J <- lists:seq(I * 50 + 1, I * 50 + 50)])
                                 || I <- lists:seq(0, 199)],
                                Self ! {done, self()}
                        end),
    [set_lanes(L) || L <- [2, 3, 1, 2]],
    receive {done, Sender} -> ok after 60000 -> ct:fail(sender_stuck) end,
    ok = convoy:flush(),
    ?assertEqual({10000, 0, 0}, await_count(Col, 10000)).

%%--------------------------------------------------------------------
%% Helpers

%% A lanes change, once the one before it is done.
set_lanes(L) ->
    case convoy:set_config(#{lanes => L}) of
        ok -> ok;
        {error, {busy, lanes}} -> timer:sleep(5), set_lanes(L)
    end.

lanes() ->
    convoy_ct_peers:lanes().

%% {Count, Gaps, Duplicated} once Count reaches N (or after 20 s).
await_count(Col, N) ->
    Deadline = erlang:monotonic_time(millisecond) + 20000,
    await_count(Col, N, Deadline).

await_count(Col, N, Deadline) ->
    Col ! {count, self()},
    receive
        {count, Col, Count, Gaps, Dup} ->
            case Count >= N orelse erlang:monotonic_time(millisecond) > Deadline of
                true -> {Count, Gaps, Dup};
                false -> timer:sleep(20), await_count(Col, N, Deadline)
            end
    after 20000 ->
        ct:fail(collector_silent)
    end.

%% The numbers received, in arrival order (one sender only).
received(Col) ->
    Col ! {received, self()},
    receive {received, Col, L} -> L after 20000 -> ct:fail(collector_silent) end.

%% Per sender, numbers must go up by one: a number past the next is a gap (a
%% loss or a reordering), one not above the last a reordering or a duplicate.
collector() ->
    collector(#{}, 0, 0, 0, []).

collector(Last, Count, Reordered, Dup, Got) ->
    receive
        {count, ReplyTo} ->
            ReplyTo ! {count, self(), Count, Reordered, Dup},
            collector(Last, Count, Reordered, Dup, Got);
        {received, ReplyTo} ->
            ReplyTo ! {received, self(), lists:reverse(Got)},
            collector(Last, Count, Reordered, Dup, Got);
        {seq, From, I, _Payload} ->
            collector(Last, Count, Reordered, Dup, Got, From, I);
        {seq, From, I} ->
            collector(Last, Count, Reordered, Dup, Got, From, I)
    end.

collector(Last, Count, Reordered, Dup, Got, From, I) ->
    case maps:get(From, Last, 0) of
        Prev when I =:= Prev + 1 ->
            collector(Last#{From => I}, Count + 1, Reordered, Dup, [I | Got]);
        Prev when I =< Prev ->
            collector(Last, Count + 1, Reordered, Dup + 1, [I | Got]);
        _Gap ->
            collector(Last#{From => I}, Count + 1, Reordered + 1, Dup, [I | Got])
    end.
