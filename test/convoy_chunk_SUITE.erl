%% Large messages sent in pieces (convoy_chunk), with peer nodes: order across
%% small and chunked messages from many senders to many receivers, exact delivery
%% of binaries and other terms around piece boundaries, a sender and a node killed
%% mid-message, forged pieces, stray DOWNs and nodedowns, senders that gave up
%% their turn, and the receiver's reassembly bound, shared by its inboxes. The
%% peers send (with small pieces so that messages have many of them); this node
%% receives, except where a receiving peer is stopped (SIGSTOP) or its inbox
%% killed: then this node sends.
-module(convoy_chunk_SUITE).

-include_lib("common_test/include/ct.hrl").
-include_lib("stdlib/include/assert.hrl").

-export([all/0, suite/0, init_per_testcase/2, end_per_testcase/2]).
-export([order_many_senders/1, exact_delivery/1, sender_killed_mid_message/1,
         node_killed_mid_message/1, forged_pieces/1, reassembly_bound/1,
         plain_peer_gets_whole/1, old_path_when_infinity/1, path_pieces_by_version/1,
         turn_passes_from_silent_sender/1, stray_ticks_counted/1,
         stray_down_keeps_message/1, stray_nodedown_keeps_message/1,
         gave_up_turns_release_reservations/1, bound_shared_by_inboxes/1,
         guard_cuts_only_with_small_traffic/1, guard_sees_small_traffic_with_max_delay/1,
         guard_sees_small_traffic_on_other_lanes/1, receiver_stopped_mid_message/1,
         large_to_stopped_node/1, inbox_killed_mid_message/1]).
%% Run on peer nodes, or spawned.
-export([run_senders/1, sender/2, collector/0, forge/3, run_plan/2, spawn_sender/2,
         send_and_stay/1, hold/4, hold_many/4,
         exact_msgs/0, make/1, hold/3, small_then_large_on_other_lane/3, sink/0]).

-define(INBOX, convoy_inbox_1).
%% Sender settings: messages from 70,000 bytes go in pieces of 1 KiB, whether or
%% not small messages went before (chunk_guard); a long barrier_timeout so that a
%% loaded machine does not make senders give up waiting.
-define(SENDER, #{chunk_threshold => 70000, chunk_bytes => 1024, chunk_window => 4,
                  chunk_guard => always, barrier_timeout => 10000}).
%% This node's settings towards a peer that stops: pieces of 16 KiB, 4 of them
%% unacknowledged at most; an answer and a busy connection each waited for 500 ms.
-define(STOPPING, #{chunk_threshold => 70000, chunk_bytes => 16384, chunk_window => 4,
                    chunk_guard => always, barrier_timeout => 500, block_timeout => 500}).
%% What a send may take once the peer stops: at most one wait for an answer and
%% one for the busy connection (1 s), with room for a loaded machine.
-define(STOPPED_BOUND_MS, 2000).

suite() ->
    [{timetrap, {seconds, 180}}].

all() ->
    [order_many_senders, exact_delivery, sender_killed_mid_message, node_killed_mid_message,
     forged_pieces, reassembly_bound, plain_peer_gets_whole, old_path_when_infinity,
     path_pieces_by_version, turn_passes_from_silent_sender, stray_ticks_counted,
     stray_down_keeps_message, stray_nodedown_keeps_message,
     gave_up_turns_release_reservations, bound_shared_by_inboxes,
     guard_cuts_only_with_small_traffic,
     guard_sees_small_traffic_with_max_delay, guard_sees_small_traffic_on_other_lanes,
     receiver_stopped_mid_message, large_to_stopped_node, inbox_killed_mid_message].

init_per_testcase(_TC, Config) ->
    ok = convoy_ct_peers:restart_here(),
    Config.

end_per_testcase(_TC, _Config) ->
    _ = application:stop(convoy),
    ok.

%%--------------------------------------------------------------------
%% Test cases

%% 8 senders on the peer, each sending 40 messages to each of 3 receivers here,
%% small ones and large ones (binaries and tuples holding binaries) interleaved:
%% every receiver gets every sender's messages exactly once, in the order sent.
order_many_senders(_Config) ->
    {Peer, _A} = convoy_peer(?SENDER),
    Recs = [spawn_link(?MODULE, collector, []) || _ <- lists:seq(1, 3)],
    ok = peer:call(Peer, ?MODULE, run_plan, [Recs, 8], 120000),
    lists:foreach(
      fun(R) ->
              Got = await_count(R, 8 * 40),
              [?assertEqual([msg(S, I, R) || I <- lists:seq(1, 40)],
                            [M || M <- Got, tag_of(M) =:= S]) || S <- lists:seq(1, 8)]
      end, Recs),
    %% Every large message went in pieces (a quarter of them are small).
    ?assertMatch(#{chunked := 720, stalled := 0}, peer_node_info(Peer)),
    ?assertEqual(0, maps:get(bad_piece, rejected())),
    ?assertEqual(0, partials(whereis(?INBOX))).

%% On the peer: Senders processes, each sending its 40 messages to each receiver.
run_plan(Recs, Senders) ->
    run_senders([[{R, msg(S, I, R)} || I <- lists:seq(1, 40), R <- Recs]
                 || S <- lists:seq(1, Senders)]).

%% Message I from sender S to receiver R: small, a binary or a tuple with a
%% binary and a map, by I.
msg(S, I, R) ->
    Len = 70000 + (I * 7919) rem 9000,
    case I rem 4 of
        0 -> {S, I, small};
        1 -> <<S:32, I:32, (binary:copy(<<(I rem 256)>>, Len))/binary>>;
        2 -> {S, I, R, binary:copy(<<"t">>, Len), #{k => I, l => lists:seq(1, I)}};
        3 -> {S, I, [binary:copy(<<"u">>, Len div 2), binary:copy(<<"v">>, Len div 2)]}
    end.

tag_of(<<S:32, _/binary>>) -> S;
tag_of(T) when is_tuple(T) -> element(1, T).

%% Binaries and terms of sizes around the piece size's multiples arrive exactly;
%% so do terms whose encoding is not a binary's (maps, nested tuples, lists).
exact_delivery(_Config) ->
    {Peer, _A} = convoy_peer(?SENDER#{large_threshold => 1000, chunk_threshold => 1000}),
    Rec = spawn_link(?MODULE, collector, []),
    Msgs = exact_msgs(),
    ok = peer:call(Peer, ?MODULE, run_senders, [[[{Rec, {make, exact, I}}
                                                   || I <- lists:seq(1, length(Msgs))]]],
                   120000),
    Got = await_count(Rec, length(Msgs)),
    [?assertEqual(M, G) || {M, G} <- lists:zip(Msgs, Got)],
    ?assertMatch(#{chunked := 25, stalled := 0}, peer_node_info(Peer)),
    25 = length(Msgs).

%% A sender killed while its message is half sent: the partial message is
%% discarded and counted, nothing is delivered, nothing stays held.
sender_killed_mid_message(_Config) ->
    {Peer, _A} = convoy_peer(?SENDER#{chunk_window => 1}),
    Rec = spawn_link(?MODULE, collector, []),
    Before = rejected(),
    Sender = peer:call(Peer, ?MODULE, spawn_sender, [Rec, {make, big, 20000000}]),
    Inbox = whereis(?INBOX),
    await(fun() -> held(Inbox, node(Sender)) end, fun(H) -> H > 0 end, 20000),
    await(fun() -> partials(Inbox) end, fun(P) -> P =:= 1 end, 20000),
    true = peer:call(Peer, erlang, exit, [Sender, kill]),
    await(fun() -> partials(Inbox) end, fun(P) -> P =:= 0 end, 20000),
    ?assertEqual(0, held(Inbox, node(Sender))),
    ?assertEqual(1, maps:get(partial_discarded, rejected()) - maps:get(partial_discarded, Before)),
    ?assertEqual([], ask(Rec, received)),
    ?assertEqual(0, maps:get(bad_piece, rejected()) - maps:get(bad_piece, Before)).

big(N) -> {big, binary:copy(<<"k">>, N)}.

exact_msgs() ->
    Sizes = [1000, 1023, 1024, 1025, 2047, 2048, 2049, 4096 * 3 - 1, 4096 * 3, 100000,
             1048576 + 1],
    Bins = [binary:copy(<<(S rem 251)>>, S) || S <- Sizes],
    Terms = [{big, binary:copy(<<"x">>, S), #{S => <<"v">>, list => lists:seq(1, 300)}}
             || S <- Sizes]
        ++ [#{a => binary:copy(<<"m">>, 5000), b => {1.5, -7, self_ref, [<<"z">>]}},
            lists:seq(1, 2000),
            {tuple, list_to_tuple(lists:seq(1, 1000))}],
    Bins ++ Terms.

%% A message described by a small term (built where it is sent, so that large
%% ones do not travel through the peer's control connection).
make({make, exact, I}) -> lists:nth(I, exact_msgs());
make({make, big, N}) -> big(N);
make({make, tagged, Tag, N}) -> {Tag, binary:copy(atom_to_binary(Tag), N)};
make(M) -> M.

%% On the peer: a process sending Spec (see make/1) to Dest.
spawn_sender(Dest, Spec) ->
    spawn(?MODULE, sender, [[{Dest, Spec}], none]).

%% The sending node is killed mid-message: the partial is discarded and counted.
node_killed_mid_message(_Config) ->
    {Peer, A} = convoy_peer(?SENDER#{chunk_window => 1}),
    Rec = spawn_link(?MODULE, collector, []),
    Before = rejected(),
    _ = peer:call(Peer, ?MODULE, spawn_sender, [Rec, {make, big, 20000000}]),
    Inbox = whereis(?INBOX),
    await(fun() -> held(Inbox, A) end, fun(H) -> H > 0 end, 20000),
    peer:stop(Peer),
    await(fun() -> partials(Inbox) end, fun(P) -> P =:= 0 end, 20000),
    ?assertEqual(0, held(Inbox, A)),
    ?assertEqual(1, maps:get(partial_discarded, rejected()) - maps:get(partial_discarded, Before)),
    ?assertEqual([], ask(Rec, received)),
    ?assertEqual(Inbox, whereis(?INBOX)),
    %% the node's row of reservations goes with its nodedown
    await(fun() -> ets:lookup(convoy_reassembly, A) end, fun(Row) -> Row =:= [] end, 20000).

%% 10,000 forged pieces from a peer: pieces of messages never started, pieces
%% out of sequence and repeated, a second start of a message in progress, starts
%% replacing each other, a piece past the announced size, a completed "term"
%% that does not decode. Nothing is delivered, every one is counted, the inbox
%% stays up and its memory does not grow; an honest message sent afterwards
%% arrives.
forged_pieces(_Config) ->
    {Peer, A} = convoy_peer(?SENDER),
    Rec = spawn_link(?MODULE, collector, []),
    Inbox = whereis(?INBOX),
    erlang:garbage_collect(Inbox),
    {memory, Mem0} = process_info(Inbox, memory),
    Before = rejected(),
    Counts = peer:call(Peer, ?MODULE, forge, [{?INBOX, node()}, Rec, 10000], 120000),
    ct:pal("forged: ~p", [Counts]),
    #{bad := Bad, replaced := Replaced, total := 10000} = Counts,
    %% A barrier from the peer behind the forged batches: all were handled.
    await(fun() -> maps:get(bad_piece, rejected()) - maps:get(bad_piece, Before) end,
          fun(N) -> N =:= Bad end, 60000),
    %% the last partial goes with its sender's DOWN or, as the forger never
    %% monitors the inbox, a later tick
    await(fun() -> maps:get(partial_discarded, rejected())
                       - maps:get(partial_discarded, Before) end,
          fun(N) -> N >= Replaced end, 60000),
    ?assertEqual(Replaced, maps:get(partial_discarded, rejected())
                 - maps:get(partial_discarded, Before)),
    ?assert(partials(Inbox) =< 1),
    ?assert(held(Inbox, A) =< 1000000),
    erlang:garbage_collect(Inbox),
    {memory, Mem1} = process_info(Inbox, memory),
    ct:pal("inbox memory ~b -> ~b", [Mem0, Mem1]),
    ?assert(Mem1 < Mem0 + 2000000),
    ?assertEqual(Inbox, whereis(?INBOX)),
    ok = peer:call(Peer, ?MODULE, run_senders, [[[{Rec, {make, big, 100000}}]]], 60000),
    ?assertEqual([big(100000)], await_count(Rec, 1)).

%% With a bound of 3 MB for partial messages per node, held 2.5 MB by a message
%% in progress (forged: its sender never sends the rest), a 1 MB message is
%% refused (counted) and sent whole instead: it arrives, and the bytes held
%% never pass the bound. The holder's death frees its reservation.
reassembly_bound(_Config) ->
    ok = convoy:set_config(#{max_reassembly_bytes => 3000000}),
    {Peer, A, Rec, Inbox, Before, Holder} = silent_holder(),
    ok = peer:call(Peer, ?MODULE, run_senders, [[[{Rec, {make, tagged, one, 1000000}}]]], 60000),
    ?assertEqual([make({make, tagged, one, 1000000})], await_count(Rec, 1)),
    ?assertEqual(2500000, held(Inbox, A)),
    ?assertEqual(1, maps:get(reassembly_full, rejected()) - maps:get(reassembly_full, Before)),
    ?assertMatch(#{chunked := 0, stalled := 0}, peer_node_info(Peer)),
    holder_killed(Peer, A, Inbox, Before, Holder).

%% A peer with convoy set to ?SENDER, a collector here and, from a process on
%% the peer, a message of 2.5 MB started to it and never sent further.
silent_holder() ->
    {Peer, A} = convoy_peer(?SENDER),
    Rec = spawn_link(?MODULE, collector, []),
    Inbox = whereis(?INBOX),
    Before = rejected(),
    Holder = peer:call(Peer, ?MODULE, hold, [{?INBOX, node()}, Rec, 2500000]),
    await(fun() -> held(Inbox, A) end, fun(H) -> H =:= 2500000 end, 20000),
    {Peer, A, Rec, Inbox, Before, Holder}.

%% The holder's death discards its message (counted) and frees its reservation.
holder_killed(Peer, A, Inbox, Before, Holder) ->
    true = peer:call(Peer, erlang, exit, [Holder, kill]),
    await(fun() -> held(Inbox, A) end, fun(H) -> H =:= 0 end, 20000),
    ?assertEqual(0, partials(Inbox)),
    ?assertEqual(1, maps:get(partial_discarded, rejected()) - maps:get(partial_discarded, Before)).

%% A node's messages in pieces take turns: a message in progress whose sender
%% went silent (forged: it never sends the rest) has the turn, and a real
%% sender's message starts behind it. The silent one gives up its turn after
%% two ticks without a piece (tens of ms, far under the sender's
%% barrier_timeout of 10 s), so the real message still goes in pieces: it
%% arrives, counted chunked and never stalled, and the silent one stays held
%% until its sender dies.
turn_passes_from_silent_sender(_Config) ->
    {Peer, A, Rec, Inbox, Before, Holder} = silent_holder(),
    {Us, ok} = timer:tc(peer, call, [Peer, ?MODULE, run_senders,
                                     [[[{Rec, {make, tagged, one, 1000000}}]]], 60000]),
    ?assertEqual([make({make, tagged, one, 1000000})], await_count(Rec, 1)),
    ?assert(Us < 5000000),
    ?assertMatch(#{chunked := 1, stalled := 0}, peer_node_info(Peer)),
    ?assertEqual(2500000, held(Inbox, A)),
    ?assertEqual(1, partials(Inbox)),
    ?assertEqual(0, maps:get(bad_piece, rejected()) - maps:get(bad_piece, Before)),
    holder_killed(Peer, A, Inbox, Before, Holder).

%% Messages shaped like the turns' tick but not its timer's are counted, and
%% the inbox goes on.
stray_ticks_counted(_Config) ->
    ok = convoy:set_config(?SENDER),
    Inbox = whereis(?INBOX),
    Before = maps:get(unknown_message, rejected()),
    Inbox ! {timeout, make_ref(), convoy_chunk_tick},
    Inbox ! {timeout, not_a_ref, convoy_chunk_tick},
    _ = sys:get_state(Inbox),
    ?assertEqual(Before + 2, maps:get(unknown_message, rejected())),
    ?assertEqual(Inbox, whereis(?INBOX)).

%% A `DOWN' naming a sender whose message is half sent in pieces, with a
%% reference that is not the inbox's monitor (anyone can send one to the
%% registered inbox), is counted and discards nothing: the message arrives
%% whole, between the sender's messages before and after it.
stray_down_keeps_message(_Config) ->
    stray_during_stream(fun(Sender, _Node) ->
                                {'DOWN', make_ref(), process, Sender, noconnection}
                        end).

%% The same with a `nodedown' for the sending node while it is connected.
stray_nodedown_keeps_message(_Config) ->
    stray_during_stream(fun(_Sender, Node) -> {nodedown, Node} end).

stray_during_stream(Stray) ->
    {Peer, A} = convoy_peer(?SENDER),
    Rec = spawn_link(?MODULE, collector, []),
    Inbox = whereis(?INBOX),
    Before = rejected(),
    Specs = [{first, 1}, {make, big, 20000000}, {third, 3}],
    Sender = peer:call(Peer, erlang, spawn, [?MODULE, sender, [[{Rec, S} || S <- Specs], self()]]),
    await(fun() -> partials(Inbox) end, fun(P) -> P =:= 1 end, 20000),
    %% The inbox held still mid-message: the stray comes between two pieces.
    ok = sys:suspend(Inbox),
    ?assertEqual(1, partials(Inbox)),
    Inbox ! Stray(Sender, A),
    ok = sys:resume(Inbox),
    receive {sent, Sender} -> ok after 60000 -> ct:fail(sender_not_done) end,
    ?assertMatch(#{chunked := 1, stalled := 0}, peer_node_info(Peer)),
    ?assertEqual([make(S) || S <- Specs], await_count(Rec, 3)),
    Diff = fun(K) -> maps:get(K, rejected()) - maps:get(K, Before) end,
    ?assertEqual({1, 0, 0}, {Diff(unknown_message), Diff(partial_discarded), Diff(bad_piece)}).

%% Senders whose first piece waited too long for its turn (behind a holder
%% that keeps it for a tick or two, while they wait 2 ms) give up, send their
%% message whole (it arrives) and stay alive. Their partials can no longer be
%% completed: they are discarded once the senders no longer monitor the inbox,
%% so the bytes reserved for the node come back to 0 once the holder is gone,
%% and a later large message from that node goes in pieces (it used to be
%% refused, the reservations left standing for as long as their senders lived).
gave_up_turns_release_reservations(_Config) ->
    ok = convoy:set_config(#{max_reassembly_bytes => 3500000}),
    {Peer, A} = convoy_peer(?SENDER#{barrier_timeout => 2}),
    Rec = spawn_link(?MODULE, collector, []),
    Inbox = whereis(?INBOX),
    Before = rejected(),
    Holder = peer:call(Peer, ?MODULE, hold, [{?INBOX, node()}, Rec, 10000]),
    await(fun() -> held(Inbox, A) end, fun(H) -> H =:= 10000 end, 20000),
    Specs = [{make, tagged, T, 500000} || T <- [g1, g2, g3]],          % 1 MB each
    Senders = peer:call(Peer, ?MODULE, send_and_stay, [[[{Rec, S}] || S <- Specs]], 60000),
    ?assertEqual(lists:sort([make(S) || S <- Specs]), lists:sort(await_count(Rec, 3))),
    #{stalled := GaveUp, chunked := Chunked} = peer_node_info(Peer),
    ct:pal("senders that gave up: ~b of 3", [GaveUp]),
    ?assert(GaveUp >= 1),
    true = peer:call(Peer, erlang, exit, [Holder, kill]),
    await(fun() -> held(Inbox, A) end, fun(H) -> H =:= 0 end, 20000),
    ?assertEqual(0, partials(Inbox)),
    ?assertEqual([true, true, true], [peer:call(Peer, erlang, is_process_alive, [P]) || P <- Senders]),
    ?assertEqual(GaveUp + 1, maps:get(partial_discarded, rejected())
                 - maps:get(partial_discarded, Before)),
    ok = peer:call(Peer, convoy, set_config, [#{barrier_timeout => 10000}]),
    Later = {make, tagged, later, 200000},
    ok = peer:call(Peer, ?MODULE, run_senders, [[[{Rec, Later}]]], 60000),
    ?assertEqual(make(Later), lists:last(await_count(Rec, 4))),
    ?assertMatch(#{chunked := C} when C =:= Chunked + 1, peer_node_info(Peer)),
    ?assertEqual(0, maps:get(reassembly_full, rejected()) - maps:get(reassembly_full, Before)).

%% On the peer: one process per list of {Dest, Msg}, each sending its list with
%% convoy:send/2 and then staying alive; returns their pids once all are done.
send_and_stay(Lists) ->
    Self = self(),
    Pids = [spawn(fun() -> sender(L, Self), receive stop -> ok end end) || L <- Lists],
    [receive {sent, P} -> ok end || P <- Pids],
    Pids.

%% max_reassembly_bytes bounds a node's partial messages in all the inboxes
%% they arrive at together. With two inboxes and a bound of 3 MB: 2.5 MB held
%% at inbox 1 leaves no room for 1 MB at inbox 2 (refused, counted), and the
%% other way round once the first holder is gone; 12 starts of 500 KB at once,
%% at both inboxes, keep at most 6; an inbox restarted gives back what its
%% previous run reserved. The table of reservations has one writer, its owner.
bound_shared_by_inboxes(_Config) ->
    ok = application:stop(convoy),
    ok = application:set_env(convoy, lanes, 2),
    try
        {ok, _} = application:ensure_all_started(convoy),
        shared_bound()
    after
        application:unset_env(convoy, lanes)
    end.

shared_bound() ->
    ok = convoy:set_config(#{max_reassembly_bytes => 3000000}),
    {Peer, A} = convoy_peer(?SENDER),
    Rec = spawn_link(?MODULE, collector, []),
    [In1, In2] = Inboxes = [{I, node()} || I <- [convoy_inbox_1, convoy_inbox_2]],
    Before = rejected(),
    {H1, 0} = hold_answer(Peer, In1, Rec, 2500000),
    {_, refused} = hold_answer(Peer, In2, Rec, 1000000),
    ?assertEqual(2500000, reserved(A)),
    true = peer:call(Peer, erlang, exit, [H1, kill]),
    await(fun() -> reserved(A) end, fun(R) -> R =:= 0 end, 20000),
    {H3, 0} = hold_answer(Peer, In2, Rec, 1000000),
    {_, refused} = hold_answer(Peer, In1, Rec, 2500000),
    ?assertEqual(1000000, reserved(A)),
    ?assertEqual(2, maps:get(reassembly_full, rejected()) - maps:get(reassembly_full, Before)),
    true = peer:call(Peer, erlang, exit, [H3, kill]),
    await(fun() -> reserved(A) end, fun(R) -> R =:= 0 end, 20000),
    Answers = peer:call(Peer, ?MODULE, hold_many, [Inboxes, Rec, 500000, 12], 60000),
    Kept = length([ok || {_, 0} <- Answers]),
    ct:pal("answers: ~p", [[Answer || {_, Answer} <- Answers]]),
    ?assertEqual(12, Kept + length([ok || {_, refused} <- Answers])),
    ?assert(Kept =< 6),
    ?assertEqual(Kept * 500000, reserved(A)),
    ?assertEqual(reserved(A), convoy_chunk_bound:reserved(A)),
    ?assertEqual({whereis(convoy_chunk_bound), protected},
                 {ets:info(convoy_reassembly, owner), ets:info(convoy_reassembly, protection)}),
    Old = [whereis(I) || {I, _} <- Inboxes],
    [exit(P, kill) || P <- Old],
    New = await(fun() -> [whereis(I) || {I, _} <- Inboxes] end,
                fun(Ps) -> lists:all(fun(P) -> is_pid(P) andalso not lists:member(P, Old) end, Ps)
                end, 20000),
    [_ = sys:get_state(P) || P <- New],         % past their start
    ?assertEqual(0, convoy_chunk_bound:reserved(A)).

%% Bytes reserved for Node's partial messages in all inboxes.
reserved(Node) ->
    lists:sum([held(whereis(I), Node) || I <- [convoy_inbox_1, convoy_inbox_2]]).

%% A holder (hold/4) on the peer and the inbox's first answer to its start.
hold_answer(Peer, Inbox, To, Size) ->
    Holder = peer:call(Peer, ?MODULE, hold, [Inbox, To, Size, self()]),
    receive
        {held, Holder, Answer} -> {Holder, Answer}
    after 20000 ->
        ct:fail({no_answer, Holder})
    end.

%% On the peer: N holders at once, taking Inboxes in turn; their pids and first
%% answers.
hold_many(Inboxes, To, Size, N) ->
    Holders = [hold(lists:nth(I rem length(Inboxes) + 1, Inboxes), To, Size, self())
               || I <- lists:seq(1, N)],
    [receive {held, H, Answer} -> {H, Answer} after 20000 -> {H, none} end || H <- Holders].

%% On the peer: a process that starts a message of Size bytes to To and sends
%% nothing more. Like a sender of pieces, it monitors the inbox (the alias its
%% answers go to) while the message is in progress.
hold(Inbox, To, Size) ->
    hold(Inbox, To, Size, none).

%% The same, telling ReplyTo the inbox's first answer: `{held, Holder, Answer}',
%% Answer 0 (acknowledged) or `refused'.
hold(Inbox, To, Size, ReplyTo) ->
    spawn(fun() ->
                  Ref = erlang:monitor(process, Inbox, [{alias, demonitor}]),
                  Inbox ! convoy_wire:batch(node(), [convoy_wire:piece_start(Ref, self(), To,
                                                                             binary, Size, <<"h">>)]),
                  ReplyTo =:= none orelse receive
                                              {Ref, convoy_piece, Answer} ->
                                                  ReplyTo ! {held, self(), Answer}
                                          end,
                  receive stop -> ok end
          end).

%% A peer without convoy gets large messages whole (plain sends), never pieces.
plain_peer_gets_whole(_Config) ->
    {Peer, B} = convoy_ct_peers:start(?MODULE, ?CT_PEER_NAME(), #{}),
    convoy_ct_peers:await_route(B, plain),
    Rec = peer:call(Peer, erlang, spawn, [?MODULE, collector, []]),
    ok = convoy:set_config(?SENDER),
    Msgs = [big(200000), binary:copy(<<"p">>, 300000)],
    run_senders([[{Rec, M} || M <- Msgs]]),
    ?assertEqual(Msgs, await_count(Rec, 2)),
    #{nodes := #{B := #{chunked := 0}}} = convoy:info().

%% chunk_threshold infinity: large messages go whole, as before.
old_path_when_infinity(_Config) ->
    {Peer, _A} = convoy_peer(?SENDER#{chunk_threshold => infinity}),
    Rec = spawn_link(?MODULE, collector, []),
    Specs = [{make, big, 200000}, {make, tagged, p, 300000}, {small, 1}],
    Msgs = [make(S) || S <- Specs],
    ok = peer:call(Peer, ?MODULE, run_senders, [[[{Rec, S} || S <- Specs]]], 60000),
    ?assertEqual(Msgs, await_count(Rec, 3)),
    ?assertMatch(#{chunked := 0}, peer_node_info(Peer)).

%% A tuple around a large binary goes as its skeleton and the binary (kind
%% `path', protocol version 3): the binary delivered is a part of the joined
%% bytes, not a copy made by decoding. To a peer whose route says version 2 the
%% same message goes encoded whole, and arrives as a binary of its own. (This
%% node reads version 3; the sender's route to it is rewritten as a version-2
%% peer's would be.)
path_pieces_by_version(_Config) ->
    {Peer, _A} = convoy_peer(?SENDER),
    Rec = spawn_link(?MODULE, collector, []),
    Tracer = convoy_ct_peers:trace_inbox(?INBOX),
    Spec = {make, tagged, p, 300000},
    {p, Bin} = Msg = make(Spec),
    ok = peer:call(Peer, ?MODULE, run_senders, [[[{Rec, Spec}]]], 60000),
    [{p, Got3}] = await_count(Rec, 1),
    ?assertEqual(Bin, Got3),
    ?assert(binary:referenced_byte_size(Got3) > byte_size(Bin)),
    Here = node(),
    ok = peer:call(Peer, convoy_ct_peers, route_as_version, [Here, 2]),
    {convoy, 2, _} = peer:call(Peer, convoy_peers, route, [Here]),
    ok = peer:call(Peer, ?MODULE, run_senders, [[[{Rec, Spec}]]], 60000),
    [_, {p, Got2} = Msg2] = await_count(Rec, 2),
    ?assertEqual(Msg, Msg2),
    ?assertEqual(byte_size(Bin), binary:referenced_byte_size(Got2)),
    ?assertMatch(#{chunked := 2, stalled := 0}, peer_node_info(Peer)),
    ?assertEqual(0, maps:get(bad_piece, rejected())),
    %% the start pieces: at version 3 with an acknowledgement every
    %% chunk_window div 2 pieces and kind path, at version 2 as version 2 has them
    Starts = [D || {'$convoy_piece', _, 0, _, D} <- convoy_ct_peers:traced(Tracer)],
    ?assertMatch([{_, _, {path, [2], _}, _, 2}, {_, _, term, _}], Starts).

%% chunk_guard (default 1000 ms): bulk alone goes whole, as fast as `!'; once a
%% small message took the sender's lane, large ones go in pieces.
guard_cuts_only_with_small_traffic(_Config) ->
    guarded(maps:remove(chunk_guard, ?SENDER)).

%% The same when max_delay asks for batches (small sends then never bypass the
%% lane, and their time is still recorded).
guard_sees_small_traffic_with_max_delay(_Config) ->
    guarded((maps:remove(chunk_guard, ?SENDER))#{max_delay => 100}).

guarded(Settings) ->
    {Peer, _A} = convoy_peer(Settings),
    Rec = spawn_link(?MODULE, collector, []),
    Bulk = [{make, big, 200000}, {make, tagged, p, 300000}],
    ok = peer:call(Peer, ?MODULE, run_senders, [[[{Rec, S} || S <- Bulk]]], 60000),
    ?assertEqual([make(S) || S <- Bulk], await_count(Rec, 2)),
    ?assertMatch(#{chunked := 0}, peer_node_info(Peer)),
    Mixed = [{small, 1}, {make, big, 250000}],
    ok = peer:call(Peer, ?MODULE, run_senders, [[[{Rec, S} || S <- Mixed]]], 60000),
    ?assertEqual([make(S) || S <- Bulk ++ Mixed], await_count(Rec, 4)),
    ?assertMatch(#{chunked := 1}, peer_node_info(Peer)).

%% With two lanes, a small message on one lane makes a large message on the
%% other go in pieces: both share the node's one distribution connection.
guard_sees_small_traffic_on_other_lanes(_Config) ->
    {Peer, _A} = convoy_peer((maps:remove(chunk_guard, ?SENDER))#{lanes => 2}),
    Rec = spawn_link(?MODULE, collector, []),
    Large = {make, big, 250000},
    %% alone, a large message goes whole
    ok = peer:call(Peer, ?MODULE, run_senders, [[[{Rec, Large}]]], 60000),
    ?assertEqual([make(Large)], await_count(Rec, 1)),
    ?assertMatch(#{chunked := 0}, peer_node_info(Peer)),
    [SmallLane, LargeLane] = peer:call(Peer, ?MODULE, small_then_large_on_other_lane,
                                       [Rec, {small, 1}, Large], 60000),
    ?assertNotEqual(SmallLane, LargeLane),
    %% two senders: no order between them
    ?assertEqual(lists:sort([make(Large), {small, 1}, make(Large)]),
                 lists:sort(await_count(Rec, 3))),
    ?assertMatch(#{chunked := 1}, peer_node_info(Peer)).

%% On the peer: Small sent by one process, then Large by one whose lane (as
%% `convoy_route' picks it among 2) differs; returns both lanes.
small_then_large_on_other_lane(Dest, Small, Large) ->
    Self = self(),
    SmallSender = spawn_link(?MODULE, sender, [[{Dest, Small}], Self]),
    receive {sent, SmallSender} -> ok end,
    SmallLane = erlang:phash2(SmallSender, 2),
    LargeSender = other_lane_sender(SmallLane),
    LargeSender ! {send, Dest, Large, Self},
    receive {sent, LargeSender} -> ok end,
    [SmallLane, erlang:phash2(LargeSender, 2)].

other_lane_sender(Lane) ->
    P = spawn_link(fun() -> receive {send, D, M, From} -> sender([{D, M}], From) end end),
    case erlang:phash2(P, 2) of
        Lane -> unlink(P), exit(P, kill), other_lane_sender(Lane);
        _ -> P
    end.

%% The receiving node stops (SIGSTOP) while a 20 MB message streams to it in
%% pieces: the sender returns within its bounds (the wait for an answer, then
%% for the busy connection), not when the node continues; the message is dropped
%% and counted. (The sender is held from its first answer until the node has
%% stopped, so that the stop comes mid-message whatever the machine's speed.)
receiver_stopped_mid_message(_Config) ->
    {Peer, B, Rec} = stoppable_peer(),
    {Sender, Before} = sender_with_history(Rec),
    D0 = dropped(B),
    held_mid_message(Sender, Rec, big(20000000)),
    with_stopped(Peer, fun() ->
                               T0 = erlang:monotonic_time(millisecond),
                               true = erlang:resume_process(Sender),
                               dropped_within_bound(Sender, T0, B, D0)
                       end),
    resumed_in_order(Peer, Sender, Rec, Before).

%% The receiving inbox dies mid-message, its node up: the sender's wait ends at
%% once, not after barrier_timeout (10 s here), the message dropped and counted.
inbox_killed_mid_message(_Config) ->
    {Peer, B, Rec} = stoppable_peer(),
    ok = convoy:set_config(#{barrier_timeout => 10000}),
    {Sender, Before} = sender_with_history(Rec),
    D0 = dropped(B),
    held_mid_message(Sender, Rec, big(20000000)),
    Inbox = peer:call(Peer, erlang, whereis, [?INBOX]),
    true = peer:call(Peer, erlang, exit, [Inbox, kill]),
    %% restarted before anything more is sent (what reaches its name before
    %% that is lost, as with `!')
    await(fun() -> peer:call(Peer, erlang, whereis, [?INBOX]) end,
          fun(P) -> is_pid(P) andalso P =/= Inbox end, 10000),
    T0 = erlang:monotonic_time(millisecond),
    true = erlang:resume_process(Sender),
    dropped_within_bound(Sender, T0, B, D0),
    resumed_in_order(Peer, Sender, Rec, Before).

%% Sender told to send Msg to Rec, and suspended once the first piece is
%% answered: mid-message until it is resumed.
held_mid_message(Sender, Rec, Msg) ->
    1 = erlang:trace(Sender, true, ['receive']),
    Sender ! {send, Rec, Msg, self()},
    receive
        {trace, Sender, 'receive', {Ref, convoy_piece, 0}} when is_reference(Ref) -> ok
    after 30000 -> ct:fail(no_first_answer)
    end,
    true = erlang:suspend_process(Sender),
    1 = erlang:trace(Sender, false, ['receive']).

%% A large message to a node already stopped, its connection full: the sender
%% returns after block_timeout, the message dropped and counted.
large_to_stopped_node(_Config) ->
    {Peer, B, Rec} = stoppable_peer(),
    {Sender, Before} = sender_with_history(Rec),
    Sink = peer:call(Peer, erlang, spawn, [?MODULE, sink, []]),
    D0 = dropped(B),
    with_stopped(Peer, fun() ->
                               fill(Sink, binary:copy(<<"f">>, 65536), 4000),
                               T0 = erlang:monotonic_time(millisecond),
                               Sender ! {send, Rec, big(5000000), self()},
                               dropped_within_bound(Sender, T0, B, D0)
                       end),
    resumed_in_order(Peer, Sender, Rec, Before).

%% A peer running convoy and a collector on it. The connection's socket buffers
%% are small and fixed at both ends (this node connects), so that once the peer
%% is stopped the connection is busy after little more than the distribution
%% buffer, and stays busy: the kernel does not grow the buffers meanwhile.
stoppable_peer() ->
    Args = ["-kernel", "inet_dist_listen_options", "[{recbuf, 65536}]"],
    {Peer, B} = with_connect_options([{sndbuf, 65536}],
                                     fun() ->
                                             convoy_ct_peers:start(?MODULE, ?CT_PEER_NAME(),
                                                                   #{args => Args})
                                     end),
    ok = convoy_ct_peers:start_convoy(Peer, #{}),
    convoy_ct_peers:await_route(B, convoy),
    ok = convoy:set_config(?STOPPING),
    {Peer, B, peer:call(Peer, erlang, spawn, [?MODULE, collector, []])}.

with_connect_options(Opts, Fun) ->
    Old = application:get_env(kernel, inet_dist_connect_options),
    ok = application:set_env(kernel, inet_dist_connect_options, Opts),
    try
        Fun()
    after
        case Old of
            {ok, V} -> application:set_env(kernel, inet_dist_connect_options, V);
            undefined -> application:unset_env(kernel, inet_dist_connect_options)
        end
    end.

%% A sending process here that has sent a small message and one in pieces to
%% Rec (delivered: nothing of it is outstanding).
sender_with_history(Rec) ->
    Sender = spawn_link(fun commands/0),
    Before = [{s, 1}, make({make, tagged, a, 300000})],
    lists:foreach(fun(M) -> order(Sender, Rec, M) end, Before),
    {Sender, Before}.

%% The sender's call ends within the bound, its message counted dropped, and no
%% helper of convoy_chunk_send outlives it (the node is still stopped).
dropped_within_bound(Sender, T0, B, D0) ->
    receive
        {sent, Sender} ->
            Ms = erlang:monotonic_time(millisecond) - T0,
            ct:pal("the send returned after ~b ms; the node's counters: ~p",
                   [Ms, maps:get(B, maps:get(nodes, convoy:info()))]),
            ?assert(Ms < ?STOPPED_BOUND_MS),
            ?assertEqual(D0 + 1, dropped(B)),
            await(fun chunk_helpers/0, fun(Hs) -> Hs =:= [] end, 5000)
    after 5000 ->
        ct:fail({still_sending, erlang:process_info(Sender, current_stacktrace)})
    end.

%% Once the node continues, the sender's next messages (small, and in pieces)
%% arrive behind those sent before the stop, and the dropped one never does (its
%% partial is discarded by the next start); no late answer to the dropped
%% message stays in the sender's mailbox.
resumed_in_order(Peer, Sender, Rec, Before) ->
    ok = convoy:set_config(#{barrier_timeout => 10000}),
    After = [{s, 2}, make({make, tagged, b, 300000})],
    lists:foreach(fun(M) -> order(Sender, Rec, M) end, After),
    ?assertEqual(Before ++ After, await_count(Rec, length(Before ++ After))),
    Inbox = peer:call(Peer, erlang, whereis, [?INBOX]),
    ?assertEqual(0, maps:get(partials, peer:call(Peer, sys, get_state, [Inbox]))),
    Sender ! {mailbox, self()},
    receive {mailbox, Sender, Msgs} -> ?assertEqual([], Msgs) end.

%% Runs Fun with Peer's OS process stopped; it always continues after.
with_stopped(Peer, Fun) ->
    OsPid = peer:call(Peer, os, getpid, []),
    _ = os:cmd("kill -STOP " ++ OsPid),
    try Fun() after os:cmd("kill -CONT " ++ OsPid) end.

%% Plain sends to Sink until its node's connection is busy.
fill(_Sink, _Payload, 0) ->
    ct:fail(connection_never_busy);
fill(Sink, Payload, N) ->
    case erlang:send(Sink, Payload, [nosuspend]) of
        ok -> fill(Sink, Payload, N - 1);
        nosuspend -> ok
    end.

%% A process that sends what it is told with convoy:send/2, one at a time, and
%% says when each call returned; `mailbox' answers what its own mailbox holds.
commands() ->
    receive
        {send, Dest, Msg, From} ->
            ok = convoy:send(Dest, Msg),
            From ! {sent, self()},
            commands();
        {mailbox, From} ->
            {messages, Msgs} = erlang:process_info(self(), messages),
            From ! {mailbox, self(), Msgs},
            commands()
    end.

order(Sender, Dest, Msg) ->
    Sender ! {send, Dest, Msg, self()},
    receive {sent, Sender} -> ok after 60000 -> ct:fail({not_sent, Msg}) end.

%% The processes on this node running convoy_chunk_send's code (its helpers).
chunk_helpers() ->
    [P || P <- processes(),
          {current_stacktrace, Stack} <- [erlang:process_info(P, current_stacktrace)],
          lists:keymember(convoy_chunk_send, 1, Stack)].

dropped(Node) ->
    #{nodes := #{Node := #{dropped := D}}} = convoy:info(),
    D.

sink() ->
    receive _ -> sink() end.

%%--------------------------------------------------------------------
%% Helpers (some run on the peer)

convoy_peer(Settings) ->
    convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(), Settings).

%% On the sending node: this node's counters for the test node.
peer_node_info(Peer) ->
    Here = node(),
    #{nodes := #{Here := Info}} = peer:call(Peer, convoy, info, []),
    Info.

rejected() ->
    maps:get(rejected, convoy:info()).

%% What an inbox holds of messages in pieces (`convoy_inbox_core:summary/1'):
%% partial messages, and the bytes they reserve for Node.
partials(Inbox) ->
    maps:get(partials, sys:get_state(Inbox)).

held(Inbox, Node) ->
    maps:get(Node, maps:get(held, sys:get_state(Inbox)), 0).

await(Get, Ok, Timeout) ->
    convoy_ct_peers:await(Get, Ok, Timeout).

%% One process per list of {Dest, Msg}, each sending its list with
%% convoy:send/2; returns once all are done.
run_senders(Lists) ->
    Self = self(),
    Pids = [spawn_link(?MODULE, sender, [L, Self]) || L <- Lists],
    [receive {sent, P} -> ok end || P <- Pids],
    ok.

sender(List, ReplyTo) ->
    lists:foreach(fun({D, M}) -> ok = convoy:send(D, make(M)) end, List),
    case ReplyTo of
        none -> ok;
        _ -> ReplyTo ! {sent, self()}
    end.

%% Keeps everything it receives, in order.
collector() ->
    collector([]).

collector(Got) ->
    receive
        {'$q', received, From} ->
            From ! {'$a', self(), lists:reverse(Got)},
            collector(Got);
        Msg ->
            collector([Msg | Got])
    end.

ask(Rec, What) ->
    Rec ! {'$q', What, self()},
    receive {'$a', Rec, A} -> A after 10000 -> ct:fail({no_answer, Rec, What}) end.

await_count(Rec, N) ->
    await(fun() -> ask(Rec, received) end, fun(L) -> length(L) >= N end, 60000),
    Got = ask(Rec, received),
    ?assertEqual(N, length(Got)),
    Got.

%% On the peer: Total forged piece entries to Inbox for destination To, as
%% batches of 100. Returns how many must count as bad_piece and how many
%% partials are discarded by a later start of the same sender.
forge(Inbox, To, Total) ->
    Sender = spawn(fun() -> receive stop -> ok end end),
    Entries = forged(Sender, To, Total div 10),
    true = length(Entries) =:= Total,
    lists:foreach(fun(Batch) -> Inbox ! convoy_wire:batch(node(), Batch) end,
                  batches(Entries, 100)),
    exit(Sender, kill),
    %% 10 entries per round: 1 start replacing the previous one, then 9 bad.
    Rounds = Total div 10,
    #{total => Total, bad => 9 * Rounds, replaced => Rounds}.

forged(_Sender, _To, 0) ->
    [];
forged(Sender, To, N) ->
    Ref = alias(),
    Start = convoy_wire:piece_start(Ref, Sender, To, binary, 1000000, <<"0123456789">>),
    [Start,
     Start,                                            % a second start: bad
     convoy_wire:piece(Ref, 2, <<"x">>),               % gap
     convoy_wire:piece(alias(), 1, <<"x">>),           % unknown message
     convoy_wire:piece(Ref, 1, binary:copy(<<"o">>, 1000001)), % past the size
     convoy_wire:piece(Ref, 1, <<>>),                  % empty
     convoy_wire:piece(alias(), 5, <<"y">>),           % unknown message
     convoy_wire:piece_start(Ref, Sender, To, binary, 10, <<"01">>), % same ref again
     convoy_wire:piece(Ref, 3, <<"z">>),               % gap
     convoy_wire:piece(Ref, 7, <<"z">>)                % gap
     | forged(Sender, To, N - 1)].

batches([], _N) -> [];
batches(L, N) when length(L) =< N -> [L];
batches(L, N) ->
    {B, Rest} = lists:split(N, L),
    [B | batches(Rest, N)].
