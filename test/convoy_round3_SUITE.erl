%% Senders killed inside a wait, messages in pieces across `lanes' changes, and a
%% lone sender blocked by a stalled node: each case is one finding of the third
%% adversarial round, with peer nodes.
-module(convoy_round3_SUITE).

-include_lib("common_test/include/ct.hrl").
-include_lib("stdlib/include/assert.hrl").
-include("../src/convoy_runtime.hrl").

-export([all/0, suite/0, init_per_testcase/2, end_per_testcase/2]).
-export([killed_while_blocked_disposes/1, killed_in_barrier_wait_disposes/1,
         killed_in_send_many_disposes/1, pieces_across_lanes_changes/1,
         lone_blocked_sender_waits_once/1]).
%% Run on peer nodes.
-export([collector/0, nemesis/1]).

suite() ->
    [{timetrap, {minutes, 5}}].

all() ->
    [killed_while_blocked_disposes, killed_in_barrier_wait_disposes,
     killed_in_send_many_disposes, pieces_across_lanes_changes,
     lone_blocked_sender_waits_once].

init_per_testcase(_TC, Config) ->
    _ = application:stop(convoy),
    Config.

end_per_testcase(_TC, _Config) ->
    convoy_ct_peers:stop_local().

%%--------------------------------------------------------------------
%% A sender killed while it holds an admission

%% A sender blocked at the node's bound (its lane suspended) is killed: its
%% admission is disposed of, the lane goes idle again, and a `lanes' change
%% completes.
killed_while_blocked_disposes(_Config) ->
    %% max_delay set: every message takes the lane (a fresh sender's would
    %% otherwise go direct while the lane is calm)
    convoy_ct_peers:start_local(#{max_buffered => 5, overload => block,
                                  block_timeout => 60000, max_delay => 1000}),
    {_PeerB, B} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(r3_block), #{}),
    Sink = spawn(B, ?MODULE, collector, []),
    Lane = convoy_ct_peers:lane(B, 1),
    ok = sys:suspend(Lane),
    Sender = spawn(fun() -> [convoy:send(Sink, {n, I}) || I <- lists:seq(1, 10)] end),
    %% five held, the sixth blocked in its wait for room
    convoy_ct_peers:await(fun() -> process_info(Sender, current_function) end,
                          fun({current_function, {convoy_wait, F, _}}) ->
                                  lists:member(F, [room_loop, room]);
                             (_) -> false
                          end, 10000),
    exit(Sender, kill),
    ok = sys:resume(Lane),
    await_idle(B, 1),
    ok = convoy:set_config(#{lanes => 2}),
    await_received(Sink, 5),
    await_idle_all().

%% A marked sender waiting for a barrier's answer from a stopped node is killed.
killed_in_barrier_wait_disposes(_Config) ->
    convoy_ct_peers:start_local(#{barrier_timeout => 60000}),
    {PeerB, B} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(r3_barrier), #{}),
    Sink = spawn(B, ?MODULE, collector, []),
    Self = self(),
    Sender = spawn(fun() ->
                           %% marked: a burst through the lane
                           ok = convoy:send_many([{Sink, {n, I}} || I <- lists:seq(1, 50)]),
                           ok = convoy:flush(B),
                           Self ! marked,
                           receive go -> ok end,
                           convoy:send(Sink, {n, 51}) % a settled lane: inbox and barrier
                   end),
    receive marked -> ok after 10000 -> ct:fail(not_marked) end,
    await_received(Sink, 50),
    convoy_ct_peers:with_stopped(PeerB, fun() ->
        timer:sleep(5), % the lane settles (SETTLED_US = 1 ms)
        Sender ! go,
        convoy_ct_peers:await(fun() -> process_info(Sender, current_function) end,
                              fun({current_function, {convoy_wait, barrier, _}}) -> true;
                                 (_) -> false
                              end, 10000),
        exit(Sender, kill),
        await_idle(B, 1)
    end),
    ok = convoy:set_config(#{lanes => 2}),
    await_idle_all().

%% A sender killed in a `send_many/1' of many large-ish messages (the batch to an
%% idle lane's inbox is being encoded).
killed_in_send_many_disposes(_Config) ->
    convoy_ct_peers:start_local(#{}),
    {_PeerB, B} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(r3_many), #{}),
    Sink = spawn(B, ?MODULE, collector, []),
    Msgs = [{Sink, {n, I, lists:duplicate(2000, I)}} || I <- lists:seq(1, 1000)],
    Kills = [kill_mid_send_many(Msgs) || _ <- lists:seq(1, 10)],
    Hits = length([K || K <- Kills, K]),
    ct:pal("killed inside the distribution send: ~p of ~p", [Hits, length(Kills)]),
    ?assert(Hits > 0),
    await_idle(B, 1),
    ok = convoy:set_config(#{lanes => 2}),
    await_idle_all().

%% The sender is killed once it is inside the distribution send of its batch
%% (the encoding yields), or wherever it is when it is done polling.
kill_mid_send_many(Msgs) ->
    Sender = spawn(fun() -> receive go -> convoy:send_many(Msgs) end end),
    Sender ! go,
    Hit = poll_encoding(Sender, 1000),
    exit(Sender, kill),
    Hit.

poll_encoding(_Sender, 0) ->
    false;
poll_encoding(Sender, N) ->
    case process_info(Sender, current_function) of
        {current_function, {erts_internal, dsend_continue_trap, 1}} -> true;
        undefined -> false;
        _ -> erlang:yield(), poll_encoding(Sender, N - 1)
    end.

%%--------------------------------------------------------------------
%% Pieces across `lanes' changes

%% Senders each send rounds of a large term then 5 small messages while `lanes'
%% cycles 1..3 every 100 ms and the peer's inboxes are suspended in turn for
%% 40 ms (so deliveries of messages in pieces go unconfirmed, `sent', and the
%% node is marked unanswered): each sender's messages arrive in order, and
%% every message is delivered or counted as dropped. The thresholds are low so
%% that many messages go in pieces: a binary in an envelope (kind `path') to a
%% peer with 3 inboxes, a list (encoded) to a peer with 1. The exact case this
%% once lost order in is `convoy_switch_SUITE:lanes_change_after_pieces_then_lane'.
pieces_across_lanes_changes(_Config) ->
    convoy_ct_peers:start_local(#{barrier_timeout => 30, large_threshold => 20000,
                                  chunk_threshold => 100000, chunk_guard => always}),
    {PeerB3, B3} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(r3_pieces3),
                                                #{lanes => 3}),
    pieces_in_order(PeerB3, B3, 3, {big, binary:copy(<<"p">>, 400000)}),
    {PeerB1, B1} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(r3_pieces1), #{}),
    pieces_in_order(PeerB1, B1, 1, lists:duplicate(8000, binary:copy(<<"p">>, 48))).

pieces_in_order(Peer, B, Inboxes, Big) ->
    Sink = spawn(B, ?MODULE, collector, []),
    Nemesis = peer:call(Peer, erlang, spawn, [?MODULE, nemesis, [Inboxes]]),
    Cycler = spawn_link(fun() -> cycle_lanes(1) end),
    Self = self(),
    {NS, Rounds} = {4, 300},
    Senders = [spawn_link(fun() ->
                                  [begin
                                       convoy:send(Sink, {n, Id, R * 10, Big}),
                                       [convoy:send(Sink, {n, Id, R * 10 + K}) || K <- lists:seq(1, 5)]
                                   end || R <- lists:seq(1, Rounds)],
                                  Self ! {done, self()}
                          end) || Id <- lists:seq(1, NS)],
    [receive {done, S} -> ok after 120000 -> ct:fail(sender_stuck) end || S <- Senders],
    unlink(Cycler),
    exit(Cycler, kill),
    Nemesis ! {stop, self()},
    receive {stopped, Nemesis} -> ok after 10000 -> ct:fail(nemesis_stuck) end,
    ok = convoy:flush(B),
    Expected = NS * Rounds * 6,
    {Got, Dropped} = convoy_ct_peers:await(
                       fun() -> {received(Sink), dropped(B)} end,
                       fun({G, D}) -> length(G) + D >= Expected end, 30000),
    ct:pal("~p delivered, ~p dropped; ~p", [length(Got), Dropped,
                                            maps:get(B, maps:get(nodes, convoy:info()))]),
    Reordered = [{Id, late(Seqs)} || Id <- lists:seq(1, NS),
                                     Seqs <- [[S || {n, I, S} <- Got, I =:= Id]],
                                     Seqs =/= lists:sort(Seqs)],
    ?assertEqual([], Reordered),
    ?assertEqual(Expected, length(Got) + Dropped).

%% How many arrived after a later one.
late(Seqs) -> late(Seqs, -1, 0).

late([], _Max, N) -> N;
late([S | Rest], Max, N) when S < Max -> late(Rest, Max, N + 1);
late([S | Rest], _Max, N) -> late(Rest, S, N).

dropped(Node) ->
    #{nodes := #{Node := #{dropped := Dropped}}} = convoy:info(),
    Dropped.

cycle_lanes(N) ->
    _ = convoy:set_config(#{lanes => N}),
    receive after 100 -> ok end,
    cycle_lanes(N rem 3 + 1).

%% On the peer: suspends one of its inboxes at a time for 40 ms, every 50 ms,
%% until told to stop (never leaving one suspended).
nemesis(Inboxes) ->
    Inbox = convoy_wire:inbox_name(rand:uniform(Inboxes)),
    _ = sys:suspend(Inbox),
    receive after 40 -> ok end,
    _ = sys:resume(Inbox),
    receive
        {stop, From} -> From ! {stopped, self()}
    after 10 ->
        nemesis(Inboxes)
    end.

%%--------------------------------------------------------------------
%% One wait per stall

%% A lone sender under `block' whose node stalls pays one block_timeout, not
%% one per message.
lone_blocked_sender_waits_once(_Config) ->
    convoy_ct_peers:start_local(#{max_buffered => 50, overload => block,
                                  block_timeout => 2000, barrier_timeout => 100}),
    {PeerB, B} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(r3_lone), #{}),
    Sink = spawn(B, ?MODULE, collector, []),
    Self = self(),
    convoy_ct_peers:with_stopped(PeerB, fun() ->
        Sender = spawn_link(fun() ->
                                    T0 = erlang:monotonic_time(millisecond),
                                    [convoy:send(Sink, {n, I, binary:copy(<<"b">>, 60000)})
                                     || I <- lists:seq(1, 2000)],
                                    Self ! {took, self(), erlang:monotonic_time(millisecond) - T0}
                            end),
        receive
            {took, Sender, Ms} ->
                ct:pal("2000 sends to a stopped node took ~p ms", [Ms]),
                %% one block_timeout (2 s) and a probe's barrier_timeout, not two waits
                ?assert(Ms < 3500)
        after 20000 ->
            ct:fail(sender_stuck)
        end
    end).

%%--------------------------------------------------------------------
%% Helpers

%% Every admission to Node's lane I disposed of (a lane's slots are read by the test).
await_idle(Node, I) ->
    Slots = element(I, convoy_ct_peers:slots(Node)),
    convoy_ct_peers:await(fun() -> convoy_slots:admitted(Slots) - convoy_slots:disposed(Slots) end,
                          fun(D) -> D =:= 0 end, 10000).

await_idle_all() ->
    convoy_ct_peers:await(
      fun() ->
              [convoy_slots:admitted(S) - convoy_slots:disposed(S)
               || S <- convoy_ct_peers:all_slots()]
      end,
      fun(Ds) -> lists:all(fun(D) -> D =:= 0 end, Ds) end, 15000).

collector() ->
    collector([]).

collector(Got) ->
    receive
        {report, ReplyTo} -> ReplyTo ! {report, self(), lists:reverse(Got)}, collector(Got);
        {n, Id, Seq, _Payload} -> collector([{n, Id, Seq} | Got]);
        M -> collector([M | Got])
    end.

received(Sink) ->
    Sink ! {report, self()},
    receive {report, Sink, Got} -> Got after 10000 -> ct:fail(no_report) end.

await_received(Sink, N) ->
    await_received(Sink, N, 10000).

await_received(Sink, N, Timeout) ->
    convoy_ct_peers:await(fun() -> received(Sink) end, fun(G) -> length(G) >= N end, Timeout).
