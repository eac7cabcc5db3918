%% Properties of the lane's pure core (convoy_lane_core), without processes or
%% peers: random interleavings of sends, drains, busy (the lane waits them out;
%% a stopping lane does not), unconnected and plain peers, connections that
%% come or not, flushes, blocked senders, holds, releases, retirement and
%% shutdown. A small
%% driver plays the lane process: it carries out the actions and simulates the
%% network.
%%
%% After every step: order per sender and node kept, nothing delivered twice,
%% the lane's receive timeout in range,
%% handed = sent + dropped + held by the core (exactly), no chunk over max_batch,
%% large messages never in a chunk with others, nothing shipped for a held node, a flush answered only
%% once everything handed before it left, a blocked sender woken once, and
%% retirement only once everything is disposed of. After settling the network:
%% nothing left, every byte given back, every flush answered, every undelivered
%% message counted as dropped.
-module(prop_convoy_lane_core_tests).

-include_lib("proper/include/proper.hrl").
-include_lib("eunit/include/eunit.hrl").

-define(NODES, [a@h, b@h, c@h]).
-define(SENDERS, [1, 2, 3]).

lane_core_test_() ->
    {timeout, 600,
     fun() ->
             ?assertEqual(ok, convoy_prop:check(prop_lane_core(),
                                                [{numtests, 5000}, {to_file, user}]))
     end}.

%%--------------------------------------------------------------------
%% Generators

node_gen() -> oneof(?NODES).

cmd() ->
    frequency([{30, {send, oneof(?SENDERS), node_gen(), kind(), bytes_gen()}},
               {6, {sends, non_empty(list({oneof(?SENDERS), node_gen(), kind(), bytes_gen()}))}},
               {12, {cycle, frequency([{3, 0}, {1, choose(1, 3000)}])}},
               {6, {mode, node_gen(), mode()}},
               {4, {connect_done, node_gen(), frequency([{3, true}, {1, false}])}},
               {3, {flush, oneof([all | ?NODES])}},
               {6, {wait, node_gen(), frequency([{1, true}, {3, false}])}},
               {2, {hold, list(node_gen())}},
               {2, {release, node_gen()}},
               {1, retire}]).

bytes_gen() -> frequency([{1, 0}, {2, choose(0, 100)}]).

kind() -> frequency([{8, small}, {1, large}, {2, multicast}]).

mode() -> frequency([{4, ok}, {2, busy}, {2, unconnected}, {1, plain_busy},
                     {1, plain_unconnected}, {1, unroutable}]).

held_gen() -> oneof([none, all, non_empty(list(node_gen()))]). % control never holds no node

prop_lane_core() ->
    ?FORALL({MaxBatch, MaxDelay, Held, AutoConnect, Cmds, Shutdown},
            {choose(1, 6), oneof([0, choose(1, 5000)]), held_gen(), frequency([{4, true}, {1, false}]),
             list(cmd()), bool()},
            begin
                St0 = init(MaxBatch, MaxDelay, Held, AutoConnect),
                Result = (catch run(Cmds, St0, Shutdown)),
                ?WHENFAIL(io:format(user, "~nsettings ~p~nresult ~p~n",
                                    [{MaxBatch, MaxDelay, Held, AutoConnect, Shutdown}, Result]),
                          Result =:= ok)
            end).

%%--------------------------------------------------------------------
%% The driver

init(MB, MD, Held, AutoConnect) ->
    Behind = case Held of none -> 0; _ -> 1 end,
    #{core => convoy_lane_core:new(Held, {MB, MD}, AutoConnect),
      max_batch => MB, now => -576460752303423488, % the clock can be negative
      modes => #{}, connecting => #{},
      seq => 0, handed => 0, handed_by => #{}, bytes_by => #{},
      sent => 0, dropped => 0, disposed_by => #{}, disposed_bytes => #{},
      accepted => 0, slots_disposed => -Behind, delivered => #{}, delivered_ids => #{},
      flushes => #{}, answered => #{}, next_tag => 0, waiters => [], woken => #{},
      %% per node, blocked senders not yet woken, oldest first; wakes owed now
      blocked => #{}, owed => [],
      retire => none, shutdown => false}.

run([], St, Shutdown) ->
    St1 = settle(St, 0),
    St2 = case Shutdown of
              true -> shutdown(St1);
              false -> St1
          end,
    final(St2);
run([Cmd | Rest], St, Shutdown) ->
    St1 = cmd(Cmd, St),
    ok = check(St1, Cmd),
    run(Rest, St1, Shutdown).

cmd({send, Sender, Node, Kind, Bytes}, St = #{retire := none}) ->
    {M, St1} = handed(Sender, Node, Kind, Bytes, St),
    event({send, M}, St1);
cmd({send, _, _, _, _}, St) ->
    St; % the lane is closed: senders go to its successor
cmd({sends, Specs}, St = #{retire := none}) ->
    %% Sends the lane read back to back, handed to the core in one event.
    {Ms, St1} = lists:foldl(fun({Sender, Node, Kind, Bytes}, {Acc, S0}) ->
                                    {M, S1} = handed(Sender, Node, Kind, Bytes, S0),
                                    {[M | Acc], S1}
                            end, {[], St}, Specs),
    event({sends, Ms, length(Ms)}, St1);
cmd({sends, _}, St) ->
    St;
cmd({cycle, Dt}, St = #{now := Now}) ->
    cycle(St#{now := Now + Dt});
cmd({mode, Node, Mode}, St = #{modes := M}) ->
    St#{modes := M#{Node => Mode}};
cmd({connect_done, Node, Ok}, St = #{connecting := Cn}) ->
    case Cn of
        #{Node := _} -> event({connected, Node, Ok}, St#{connecting := maps:remove(Node, Cn)});
        _ -> St
    end;
cmd({flush, Which}, St = #{next_tag := T, flushes := F, disposed_by := D, handed_by := HB}) ->
    %% What must have left before the answer: everything handed so far.
    Need = maps:filter(fun(N, K) -> (Which =:= all orelse N =:= Which) andalso K > 0 end, HB),
    event({flush, Which, self(), T},
          St#{next_tag := T + 1, flushes := F#{T => {Need, D}}});
cmd({wait, Node, Room}, St = #{next_tag := T, waiters := W, blocked := B, owed := O}) ->
    Alias = {alias, T},
    St1 = St#{next_tag := T + 1, waiters := [{Alias, Node, Room} | W]},
    case Room of
        true -> event({wait, Node, Alias, true}, St1#{owed := [Alias | O]});
        false -> event({wait, Node, Alias, false},
                       St1#{blocked := B#{Node => maps:get(Node, B, []) ++ [Alias]}})
    end;
cmd({hold, Nodes}, St) ->
    event({hold, Nodes}, St);
cmd({release, Node}, St) ->
    event({release, Node}, St);
cmd(retire, St = #{retire := none, handed := H}) ->
    %% The lane was closed: its admissions are what senders handed it (a lane
    %% started held has its disposals one behind until it opens).
    event({retire, H}, St#{retire := requested});
cmd(retire, St) ->
    St.

handed(Sender, Node, Kind, Bytes, St = #{seq := Seq, handed := H, handed_by := HB,
                                         bytes_by := BB}) ->
    Id = {Sender, Seq},
    %% Sender 3 sends its small messages to a process registered as
    %% '$convoy_mark' (any atom is a name): its entries must not pass for marks.
    M = case Kind of
            small when Sender =:= 3 -> {'$convoy_send', Node, '$convoy_mark', Id, Bytes};
            small -> {'$convoy_send', Node, {s, Sender}, Id, Bytes};
            large -> {'$convoy_large', Node, {s, Sender}, Id, Bytes};
            multicast -> {'$convoy_multicast', Node, [{s, Sender}, {t, Sender}], Id, Bytes}
        end,
    {M, St#{seq := Seq + 1, handed := H + 1,
            handed_by := maps:update_with(Node, fun(N) -> N + 1 end, 1, HB),
            bytes_by := maps:update_with(Node, fun(N) -> N + Bytes end, Bytes, BB)}}.

%% The lane's end of a drain: a cycle, then a retiring lane reports its disposals.
cycle(St) ->
    St1 = event(cycle, St),
    case convoy_lane_core:draining(maps:get(core, St1)) of
        true -> event({admissions_disposed, maps:get(slots_disposed, St1)}, St1);
        false -> St1
    end.

event(Event, St = #{core := C, now := Now}) ->
    {C1, Actions} = convoy_lane_core:handle(Event, Now, C),
    lists:foldl(fun act/2, St#{core := C1}, Actions).

act({accepted, _Node, K}, St = #{accepted := A}) ->
    St#{accepted := A + K};
act({ship, Node, Wire, {Counted, Bytes}, _Reason},
    St = #{core := C, max_batch := MB, shutdown := Down}) ->
    Msgs = convoy_batch:count_messages(Wire),
    Counted =:= Msgs orelse throw({chunk_count, Node, Counted, Msgs}),
    Msgs =< MB orelse throw({chunk_over_max_batch, Node, Wire}),
    chunk_bytes(Node, Msgs, Bytes, St),
    Large = [E || {'$convoy_large', _, _} = E <- Wire],
    %% Large messages never share a chunk with others (a run of them may).
    (Large =:= [] orelse length(Large) =:= length(Wire)) orelse throw({large_not_alone, Wire}),
    [] =:= [E || {'$convoy_mark', _, _} = E <- Wire] orelse throw({mark_shipped, Wire}),
    Down orelse not is_held(Node, C) orelse throw({shipped_held_node, Node}),
    {Outcome, St1} = network(Node, Wire, St),
    event({shipped, Node, Outcome}, St1);
act({sent, Node, Msgs, _Sends, _Reason, _Route}, St = #{sent := S}) ->
    Msgs >= 0 orelse throw({negative_sent, Node}),
    St#{sent := S + Msgs};
act({dropped, _Node, Msgs, _Why}, St = #{dropped := D}) ->
    Msgs > 0 orelse throw({empty_drop}),
    St#{dropped := D + Msgs};
act({disposed, Node, K, Bytes}, St = #{disposed_by := D, disposed_bytes := B,
                                       slots_disposed := SD, blocked := Bl, owed := O}) ->
    %% Each message that leaves wakes one blocked sender of its node, oldest first.
    {Woken, Left} = lists:split(min(K, length(maps:get(Node, Bl, []))), maps:get(Node, Bl, [])),
    St#{blocked := Bl#{Node => Left}, owed := O ++ Woken,
        disposed_by := maps:update_with(Node, fun(N) -> N + K end, K, D),
        disposed_bytes := maps:update_with(Node, fun(N) -> N + Bytes end, Bytes, B),
        slots_disposed := SD + K};
act({wake, Alias}, St = #{woken := W, owed := O}) ->
    is_map_key(Alias, W) andalso throw({woken_twice, Alias}),
    lists:member(Alias, O) orelse throw({woken_out_of_turn, Alias, O}),
    St#{woken := W#{Alias => true}, owed := lists:delete(Alias, O)};
act({reply, _ReplyTo, Tag}, St = #{flushes := F, answered := Ans, disposed_by := D}) ->
    is_map_key(Tag, Ans) andalso throw({flush_answered_twice, Tag}),
    #{Tag := {Need, _}} = F,
    maps:foreach(fun(Node, K) ->
                         maps:get(Node, D, 0) >= K
                             orelse throw({flush_answered_early, Tag, Node, K, maps:get(Node, D, 0)})
                 end, Need),
    St#{answered := Ans#{Tag => true}};
act({connect, Node}, St = #{connecting := Cn}) ->
    is_map_key(Node, Cn) andalso throw({connecting_twice, Node}),
    St#{connecting := Cn#{Node => true}};
act({forget, _Node}, St) ->
    St;
act({dispose, 1}, St = #{slots_disposed := SD}) ->
    St#{slots_disposed := SD + 1};
act(start_barriers, St = #{retire := requested, core := C, handed := H, sent := S, dropped := D}) ->
    H =:= S + D orelse throw({barriers_before_disposed, H, S, D}),
    0 =:= convoy_lane_core:holding(C) orelse throw({barriers_while_holding}),
    %% The lane asks its barriers of two convoy peers, and they answer one by one.
    St1 = event({barriers, [a@h, b@h]}, St#{retire := barriers}),
    St2 = event({barrier_done, a@h}, St1),
    maps:get(retire, St2) =:= barriers orelse throw(retired_early),
    event({barrier_done, b@h}, St2);
act(retired, St = #{retire := barriers}) ->
    St#{retire := retired};
act({stray, _Event}, St) ->
    St;
act(Other, _St) ->
    throw({unexpected_action, Other}).

%% A chunk carries the bytes its messages took (what the lane will give back for
%% them): within what the node holds, and all of it when the chunk is all the
%% node holds (a node ships one chunk at a time, so it holds nothing else then).
chunk_bytes(Node, Msgs, Bytes, #{handed_by := HB, bytes_by := BB, disposed_by := DB,
                                 disposed_bytes := DBy}) ->
    Held = maps:get(Node, HB, 0) - maps:get(Node, DB, 0),
    HeldBytes = maps:get(Node, BB, 0) - maps:get(Node, DBy, 0),
    (Bytes >= 0 andalso Bytes =< HeldBytes) orelse throw({chunk_bytes, Node, Bytes, HeldBytes}),
    (Msgs < Held orelse Bytes =:= HeldBytes)
        orelse throw({chunk_not_all_bytes, Node, Bytes, HeldBytes}).

is_held(Node, C) ->
    case maps:get(held, convoy_lane_core:summary(C)) of
        none -> false;
        all -> true;
        Held -> is_map_key(Node, Held)
    end.

%% What the network does with a chunk, by the node's mode. A busy connection is
%% waited out (everything leaves) unless the lane is stopping.
network(Node, Wire, St = #{modes := Modes, shutdown := Down}) ->
    case maps:get(Node, Modes, ok) of
        Ok when Ok =:= ok; Ok =:= busy, not Down ->
            {{sent, 1, convoy}, deliver(Node, Wire, St)};
        plain_busy when not Down ->
            {{sent, length(Wire), plain}, deliver(Node, Wire, St)};
        busy when element(1, hd(Wire)) =:= '$convoy_large' ->
            %% A run of large messages: the first leave, in groups of up to two
            %% a send here (convoy_batch:run_groups/1), until the connection is
            %% busy.
            {Out, Rest} = lists:split(length(Wire) div 2, Wire),
            {{busy, length(Out), (length(Out) + 1) div 2, Rest, convoy}, deliver(Node, Out, St)};
        busy ->
            {{busy, 0, 0, Wire, convoy}, St};
        unconnected ->
            {{unconnected, 0, 0, Wire, convoy}, St};
        plain_busy ->
            {Out, Rest} = lists:split(length(Wire) div 2, Wire),
            {{busy, length(Out), length(Out), Rest, plain}, deliver(Node, Out, St)};
        plain_unconnected ->
            {Out, Rest} = lists:split(length(Wire) div 2, Wire),
            {{unconnected, length(Out), length(Out), Rest, plain}, deliver(Node, Out, St)};
        unroutable ->
            {unroutable, St}
    end.

deliver(Node, Wire, St) ->
    lists:foldl(fun(E, Acc) -> deliver_one(Node, id(E), Acc) end, St, Wire).

id({'$convoy_large', _To, Id}) -> Id;
id({_To, Id}) -> Id.

deliver_one(Node, {Sender, Seq} = Id, St = #{delivered := D, delivered_ids := Ids}) ->
    is_map_key(Id, Ids) andalso throw({delivered_twice, Id}),
    Last = maps:get({Node, Sender}, D, -1),
    Seq > Last orelse throw({out_of_order, Node, Sender, Seq, Last}),
    St#{delivered := D#{{Node, Sender} => Seq}, delivered_ids := Ids#{Id => true}}.

%%--------------------------------------------------------------------
%% Invariants after every step

check(#{core := C, handed := H, sent := S, dropped := D, owed := O, bytes_by := BB,
        disposed_bytes := DBy, now := Now}, _Cmd) ->
    %% The lane waits for this in a receive: out of range would crash it.
    T = convoy_lane_core:timeout(Now, C),
    T =:= infinity orelse (is_integer(T) andalso T >= 0 andalso T =< 16#FFFFFFFF)
        orelse throw({timeout_out_of_range, T}),
    Held = case maps:get(held, convoy_lane_core:summary(C)) of none -> 0; _ -> 1 end,
    H =:= S + D + convoy_lane_core:holding(C) - Held
        orelse throw({accounting, H, S, D, convoy_lane_core:holding(C)}),
    O =:= [] orelse throw({not_woken, O}),
    maps:foreach(fun(Node, B) ->
                         B =< maps:get(Node, BB, 0) andalso B >= 0
                             orelse throw({bytes_given_back, Node, B, maps:get(Node, BB, 0)})
                 end, DBy),
    ok.

%% Let the network recover and the holds go: everything leaves.
settle(St, 20) ->
    throw({does_not_settle, convoy_lane_core:summary(maps:get(core, St))});
settle(St0 = #{modes := Modes}, Round) ->
    St1 = St0#{modes := maps:map(fun(_, _) -> ok end, Modes)},
    St3 = maps:fold(fun(Node, _, Acc = #{connecting := Cn}) ->
                            event({connected, Node, true}, Acc#{connecting := maps:remove(Node, Cn)})
                    end, St1, maps:get(connecting, St1)),
    St4 = case maps:get(held, convoy_lane_core:summary(maps:get(core, St3))) of
              none -> St3;
              all -> event({hold, []}, St3);
              Held -> lists:foldl(fun(N, Acc) -> event({release, N}, Acc) end, St3, maps:keys(Held))
          end,
    St5 = cycle(St4#{now := maps:get(now, St4) + 10000}),
    ok = check(St5, settle),
    case quiet(St5) of
        true -> St5;
        false -> settle(St5, Round + 1)
    end.

quiet(#{core := C, connecting := Cn}) ->
    convoy_lane_core:holding(C) =:= 0 andalso map_size(Cn) =:= 0.

shutdown(St) ->
    St1 = event(shutdown_ship, St#{shutdown := true}),
    event(shutdown_drop, St1#{connecting := #{}}).

final(St = #{core := C, handed := H, sent := S, dropped := D, accepted := A,
             handed_by := HB, bytes_by := BB, disposed_by := DB, disposed_bytes := DBy,
             flushes := F, answered := Ans, delivered_ids := Ids, retire := Retire}) ->
    0 =:= convoy_lane_core:holding(C) orelse throw({left_in_core, convoy_lane_core:summary(C)}),
    H =:= S + D orelse throw({final_accounting, H, S, D}),
    A =:= H orelse throw({accepted, A, H}),
    HB =:= DB orelse throw({disposed_by_node, HB, DB}),
    maps:foreach(fun(Node, B) ->
                         maps:get(Node, DBy, 0) =:= B
                             orelse throw({bytes_not_given_back, Node, B, maps:get(Node, DBy, 0)})
                 end, BB),
    %% Everything not delivered was counted as dropped.
    H - map_size(Ids) =< D orelse throw({lost_uncounted, H, map_size(Ids), D}),
    lists:sort(maps:keys(F)) =:= lists:sort(maps:keys(Ans))
        orelse throw({flushes_unanswered, maps:keys(F) -- maps:keys(Ans)}),
    (Retire =:= none orelse Retire =:= retired) orelse throw({retire_stuck, Retire}),
    %% A lane that settles keeps nothing, after a cycle with no sends, for nodes
    %% it has nothing for (waiters left aside: a blocked sender not yet woken
    %% keeps its node).
    Waiting = [N || {Alias, N, false} <- maps:get(waiters, St), not is_map_key(Alias, maps:get(woken, St))],
    C1 = maps:get(core, cycle(St)),
    [] =:= convoy_lane_core:nodes(C1) -- Waiting
        orelse throw({nodes_kept, convoy_lane_core:nodes(C1), Waiting}),
    ok.

%%--------------------------------------------------------------------
%% Plain EUnit cases

%% A negative clock with max_delay raised while entries wait (the crash of a lane
%% that restarted convoy): the timeout stays a valid one.
negative_clock_delay_raised_test() ->
    Now = -576460752303423488,
    C0 = convoy_lane_core:new(all, {1000, 0}, true),
    {C1, []} = convoy_lane_core:handle({send, {'$convoy_send', a@h, p, m, 1}}, Now, C0),
    {C2, _} = convoy_lane_core:handle(cycle, Now, C1),
    {C3, []} = convoy_lane_core:handle({settings, 1000, 1000}, Now, C2),
    T = convoy_lane_core:timeout(Now + 10, C3),
    ?assert(is_integer(T) andalso T >= 0 andalso T =< 1).

stray_events_are_reported_test() ->
    C0 = convoy_lane_core:new(none, {10, 0}, true),
    ?assertMatch({_, [{stray, {release, a@h}}]}, convoy_lane_core:handle({release, a@h}, 0, C0)),
    ?assertMatch({_, [{stray, {hold, []}}]}, convoy_lane_core:handle({hold, []}, 0, C0)),
    ?assertMatch({_, [{stray, {barrier_done, a@h}}]},
                 convoy_lane_core:handle({barrier_done, a@h}, 0, C0)),
    ?assertMatch({_, [{stray, {shipped, a@h, unroutable}}]},
                 convoy_lane_core:handle({shipped, a@h, unroutable}, 0, C0)).

%% Two senders blocked on a node, one message leaves: one is woken, the older.
wakes_one_blocked_sender_per_message_test() ->
    St0 = init(5, 0, none, true),
    Cmds = [{wait, a@h, false}, {wait, a@h, false}, {send, 1, a@h, small, 1}, {cycle, 0}],
    St = lists:foldl(fun(Cmd, Acc) -> St1 = cmd(Cmd, Acc), ok = check(St1, Cmd), St1 end,
                     St0, Cmds),
    ?assertEqual(#{{alias, 0} => true}, maps:get(woken, St)).

%% Found by the property: a flush while the node cannot be reached, its message put
%% back behind the flush's mark, must still leave once the node connects (the mark
%% restarted the queue's wait, and with a negative clock it never ended).
requeued_behind_flush_mark_leaves_test() ->
    Cmds = [{flush, all}, {mode, b@h, unconnected}, {flush, all}, {send, 1, b@h, small, 0},
            {hold, []}],
    ?assertEqual(ok, catch run(Cmds, init(2, 1, all, true), false)).

%% A message to a process registered as '$convoy_mark' (or under
%% another of convoy's tags) queued with a flush mark behind it is a message like
%% any other: it ships, the flush is answered, the lane does not crash.
tag_named_destinations_test() ->
    C0 = convoy_lane_core:new(none, {1000, 1000}, true),
    Sends = [{'$convoy_send', b@h, Name, {m, Name}, 1}
             || Name <- ['$convoy_mark', '$convoy_large', '$convoy_publish', '$convoy_send']],
    {C1, _} = lists:foldl(fun(M, {C, _}) -> convoy_lane_core:handle({send, M}, 0, C) end,
                          {C0, []}, Sends),
    {C2, A2} = convoy_lane_core:handle({flush, b@h, self(), t}, 0, C1),
    ?assertMatch([{accepted, b@h, 4}, {ship, b@h, _, {4, 4}, drained}], A2),
    {ship, b@h, Wire, {4, 4}, drained} = lists:last(A2),
    ?assertEqual([{Name, Msg} || {_, _, Name, Msg, _} <- Sends], Wire),
    {_, A3} = convoy_lane_core:handle({shipped, b@h, {sent, 1, convoy}}, 0, C2),
    ?assertMatch([{sent, b@h, 4, 1, drained, convoy}, {disposed, b@h, 4, 4},
                  {reply, _, t} | _], A3).

%% A stopping lane does not wait out a busy connection: the part of a run that
%% could not leave at once goes back to its queue, in order, with the flush mark
%% behind it; nothing more is shipped for the node, and the drop at the end
%% counts the rest and answers the flush.
busy_at_shutdown_test() ->
    Cmds = [{hold, [b@h]}, {send, 1, b@h, large, 5}, {send, 1, b@h, large, 5},
            {send, 1, b@h, large, 5}, {send, 1, b@h, large, 5}, {cycle, 0}, {flush, b@h},
            {mode, b@h, busy}, {release, b@h}],
    St = lists:foldl(fun(Cmd, Acc) -> St1 = cmd(Cmd, Acc), ok = check(St1, Cmd), St1 end,
                     init(5, 0, [b@h], true), Cmds),
    ?assertEqual(0, map_size(maps:get(delivered_ids, St))), % held until now
    St1 = event(shutdown_ship, St#{shutdown := true}),
    ?assertEqual(2, map_size(maps:get(delivered_ids, St1))),
    ?assertEqual(2, convoy_lane_core:buffered(maps:get(core, St1))),
    St2 = event(shutdown_drop, St1),
    ?assertEqual(2, maps:get(dropped, St2)),
    ?assertEqual(#{0 => true}, maps:get(answered, St2)),
    ?assertEqual(ok, final(St2)).
