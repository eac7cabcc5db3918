%% The inbox core's rules on concrete cases (convoy_inbox_core): where slices
%% end, turns between nodes, runs, the order of requests for a message in
%% pieces, and what is stray. The properties are in prop_convoy_inbox_core_tests.
-module(convoy_inbox_core_tests).

-include_lib("eunit/include/eunit.hrl").

-define(HERE, 'here@h').
-define(C, 7).

pid(Node, Id, Creation) -> convoy_test_ids:pid(Node, Id, Creation).

ref(Node, Id, Creation) -> convoy_test_ids:ref(Node, Id, Creation).

p(I) -> pid(?HERE, I, ?C).

new() -> convoy_inbox_core:new().

%% convoy_inbox_core:handle/2, with a run of plain sends answered as the shell
%% answers it (convoy_plain:run/5, counting instead of sending): the run
%% shows as the sends it made, `{deliver_run, K, Entries}' (or one `deliver').
handle(Input, C) ->
    case convoy_inbox_core:handle(Input, C) of
        {C1, []} ->
            {C1, []};
        {C1, Actions} ->
            case lists:last(Actions) of
                {deliver_plain, Entries, Max, Good, Local} ->
                    {K, Rest, Good1, 0} = convoy_plain:run(Entries, Max, Good, Local, count),
                    {C2, More} = handle({delivered_plain, K, Rest, Good1}, C1),
                    {C2, lists:droplast(Actions) ++ sent(K, Entries) ++ More};
                _ ->
                    {C1, Actions}
            end
    end.

sent(0, _Entries) -> [];
sent(1, [{To, Msg} | _]) -> [{deliver, To, Msg}];
sent(K, Entries) -> [{deliver_run, K, Entries}].

batch(Node, Entries, C) ->
    handle({batch, Node, {tag, Node}, Entries, {?HERE, ?C}}, C).

slice(C) ->
    handle({slice, {?HERE, ?C}}, C).

%% A message whose copy costs about 60,000 words: four to one destination
%% overrun a slice's 2^18.
big(I) -> {I, lists:seq(1, 30000)}.

%% Multicasts of big messages to two destinations, two to a slice (the lists
%% differ from one entry to the next, so they make no run).
two_by_two(Tag, K) ->
    [{case I rem 2 of 0 -> [p(1), p(2)]; 1 -> [p(2), p(1)] end, {Tag, big(I)}}
     || I <- lists:seq(1, K)].

delivered(Actions) ->
    lists:append([case A of
                      {deliver, _, M} -> [M];
                      {deliver_run, K, Es} -> [M || {_, M} <- lists:sublist(Es, K)];
                      {deliver_each, Tos, M} -> [M || _ <- Tos];
                      _ -> []
                  end || A <- Actions]).

%% 8192 plain sends (32 word copies each) fill a slice: the rest of a batch of
%% 10,000 waits for the next one, and the node's next batch behind it.
long_batch_in_slices_test() ->
    To = p(1),
    {C1, A1} = batch(a@h, [{To, I} || I <- lists:seq(1, 10000)], new()),
    ?assertEqual(lists:seq(1, 8192), delivered(A1)),
    ?assertEqual({received, {tag, a@h}, 8192}, lists:last(A1)),
    ?assert(convoy_inbox_core:busy(C1)),
    {C2, []} = batch(a@h, [{To, later}], C1),
    {C3, A3} = slice(C2),
    ?assertEqual(lists:seq(8193, 10000), delivered(A3)),
    ?assert(convoy_inbox_core:busy(C3)),
    {C4, A4} = slice(C3),
    ?assertEqual([later], delivered(A4)),
    ?assertNot(convoy_inbox_core:busy(C4)),
    ?assertEqual({C4, []}, slice(C4)).

%% Unfinished batches of two nodes take turns; a third node's batch is
%% delivered as it comes.
turns_test() ->
    {C1, A1} = batch(a@h, two_by_two(a, 6), new()),
    {C2, A2} = batch(b@h, two_by_two(b, 4), C1),
    {C3, A3} = batch(c@h, [{p(3), c}], C2),
    ?assertEqual([c], delivered(A3)),
    {C4, A4} = slice(C3),
    {C5, A5} = slice(C4),
    {C6, A6} = slice(C5),
    ?assertNot(convoy_inbox_core:busy(C6)),
    Sent = fun(As) -> [{Tag, I} || {Tag, {I, _}} <- delivered(As)] end,
    ?assertEqual([[{a, 1}, {a, 1}, {a, 2}, {a, 2}], [{b, 1}, {b, 1}, {b, 2}, {b, 2}],
                  [{a, 3}, {a, 3}, {a, 4}, {a, 4}], [{b, 3}, {b, 3}, {b, 4}, {b, 4}],
                  [{a, 5}, {a, 5}, {a, 6}, {a, 6}]],
                 [Sent(A) || A <- [A1, A2, A4, A5, A6]]).

%% A publish entry asks for its members when the slice reaches it; its sends
%% go in slices of members, and the entry after it waits for the last one.
publish_in_slices_test() ->
    Members = [p(I) || I <- lists:seq(1, 10)],
    Msg = big(1),
    {C1, A1} = batch(a@h, [{p(20), first}, convoy_wire:publish(s, g, Msg), {p(20), after_publish}],
                     new()),
    ?assertEqual([{deliver, p(20), first}, {members, s, g}], A1),
    {C2, A2} = handle({members, {ok, Members}}, C1),
    [{publish, Now1, [Msg]}, {received, _, 2}] = A2,
    ?assertEqual(4, length(Now1)),                 % 4 x 60,000 words fit in 2^18
    {C3, [{publish, Now2, [Msg]}]} = slice(C2),
    {C4, A4} = slice(C3),
    [{publish, Now3, [Msg]}, {deliver, _, after_publish}, {received, _, 1}] = A4,
    ?assertEqual(Members, Now1 ++ Now2 ++ Now3),
    ?assertNot(convoy_inbox_core:busy(C4)).

%% Runs: publish entries to one group and multicast entries to one list go
%% destination by destination; a list naming a process twice does not run.
runs_test() ->
    Pub = fun(M) -> convoy_wire:publish(s, g, M) end,
    {C1, [{members, s, g}]} = batch(a@h, [Pub(1), Pub(2), Pub(3), {p(9), x}], new()),
    {_, A1} = handle({members, {ok, [p(1), p(2)]}}, C1),
    ?assertEqual([{publish, [p(1), p(2)], [1, 2, 3]}, {deliver, p(9), x}, {received, {tag, a@h}, 4}],
                 A1),
    {_, A2} = batch(a@h, [{[p(1), p(2)], 1}, {[p(1), p(2)], 2}, {[p(2), p(1)], 3}], new()),
    ?assertEqual([{deliver_all, p(1), [1, 2]}, {deliver_all, p(2), [1, 2]},
                  {deliver_each, [p(2), p(1)], 3}, {received, {tag, a@h}, 3}], A2),
    {_, A3} = batch(a@h, [{[p(1), p(1)], 1}, {[p(1), p(1)], 2}], new()),
    ?assertEqual([1, 1, 2, 2], delivered(A3)).

%% A run goes destination by destination only when its destinations
%% are distinct pids. A name or an alias may be the same process as a pid of the
%% list (or two names one process): each entry then goes to all its
%% destinations before the next, as a loop of `!' would send them.
runs_only_over_distinct_pids_test() ->
    Alias = ref(?HERE, 1, ?C),
    Each = fun(Tos) ->
                   {_, A} = batch(a@h, [{Tos, 1}, {Tos, 2}, {Tos, 3}], new()),
                   ?assertEqual([{deliver_each, Tos, 1}, {deliver_each, Tos, 2},
                                 {deliver_each, Tos, 3}, {received, {tag, a@h}, 3}], A)
           end,
    Each([name, p(1), p(2)]),
    Each([p(1), Alias]),
    Each([Alias, ref(?HERE, 2, ?C)]),
    Each([name, other_name]),
    %% distinct pids: still a run
    {_, A1} = batch(a@h, [{[p(1), p(2)], 1}, {[p(1), p(2)], 2}], new()),
    ?assertEqual([{deliver_all, p(1), [1, 2]}, {deliver_all, p(2), [1, 2]},
                  {received, {tag, a@h}, 2}], A1),
    %% a group's row that is not of pids (a scope that is not pg's): no run
    Pub = fun(M) -> convoy_wire:publish(s, g, M) end,
    {C2, [{members, s, g}]} = batch(a@h, [Pub(1), Pub(2)], new()),
    {C3, A3} = handle({members, {ok, [p(1), name]}}, C2),
    ?assertEqual([{publish, [p(1), name], [1]}, {members, s, g}], A3),
    {_, A4} = handle({members, {ok, [p(1), name]}}, C3),
    ?assertEqual([{publish, [p(1), name], [2]}, {received, {tag, a@h}, 2}], A4).

%% The node's name and creation come with each input, never kept: a node named
%% (or renamed) after its inbox started has its pids and aliases delivered to,
%% not rejected as another node's.
follows_the_nodes_name_test() ->
    Entries = [{p(1), 1}, {[p(2), ref(?HERE, 3, ?C)], 2}, {name, 3}],
    Handle = fun(Here, C) -> handle({batch, a@h, t, Entries, Here}, C) end,
    %% under its former name, these are another node's
    {C1, A1} = Handle({nonode@nohost, 0}, new()),
    ?assertEqual([{rejected, bad_entry}, {rejected, bad_entry}, {deliver, name, 3},
                  {received, t, 1}], A1),
    {_, A2} = Handle({?HERE, ?C}, C1),
    ?assertEqual([1, 2, 2, 3], delivered(A2)),
    %% a restart of distribution under the same name: the former creation's are
    %% undeliverable
    {_, A3} = Handle({?HERE, ?C + 1}, C1),
    ?assertEqual([{rejected, undeliverable}, {rejected, undeliverable},
                  {rejected, undeliverable}, {deliver, name, 3}, {received, t, 3}], A3).

%% On the node itself: plain sends in a row to names and live pids are one action
%% over the batch's own entries, ended by anything else (an old incarnation's pid,
%% the slice's budget), which is handled as before.
%% The shell's walk (convoy_plain:run/5 with `send'): each plain send is
%% sent as it is checked, a name nobody holds drops its message and is counted,
%% and the run ends where the counting walk ends it.
plain_run_sends_test() ->
    Local = node(),
    Cr = erlang:system_info(creation),
    Me = self(),
    Old = pid(Local, 1, Cr + 1),
    Entries = [{Me, 1}, {convoy_test_nobody_holds_this, 2}, {Me, 3}, {Old, 4}, {Me, 5}],
    Counted = convoy_plain:run(Entries, 100, undefined, Local, count),
    ?assertEqual({3, [{Old, 4}, {Me, 5}], Me, 0}, Counted),
    ?assertEqual({3, [{Old, 4}, {Me, 5}], Me, 1},
                 convoy_plain:run(Entries, 100, undefined, Local, send)),
    ?assertEqual([1, 3], flush_all()),
    %% at most Max of them
    ?assertEqual({2, [{Me, 3}, {Old, 4}, {Me, 5}], Me, 1},
                 convoy_plain:run(Entries, 2, undefined, Local, send)),
    ?assertEqual([1], flush_all()).

flush_all() ->
    receive M -> [M | flush_all()] after 0 -> [] end.

plain_runs_test() ->
    Local = node(),
    Cr = erlang:system_info(creation),
    Handle = fun(Entries, C) ->
                     handle({batch, a@h, {tag, a@h}, Entries, {Local, Cr}}, C)
             end,
    Me = self(),
    Other = spawn(fun() -> ok end),
    Old = pid(Local, 1, Cr + 1),
    Batch = convoy_wire:batch(a@h, []),
    Entries = [{Me, 1}, {Other, 2}, {Me, 3}, {Old, 4}, {Me, 5}, {Me, Batch}, {name, 7},
               {Me, 8}],
    {_, A1} = Handle(Entries, convoy_inbox_core:new()),
    %% a message shaped as a batch is a message: it does not end a run
    [{deliver_run, 3, Entries}, {rejected, undeliverable},
     {deliver_run, 4, [{Me, 5}, {Me, Batch}, {name, 7}, {Me, 8}]},
     {received, {tag, a@h}, 8}] = A1,
    ?assertEqual([1, 2, 3, 5, Batch, 7, 8], delivered(A1)),
    %% the budget ends a run as it ends a slice: 8192 sends, then the rest
    Long = [{Me, I} || I <- lists:seq(1, 10000)],
    {C2, A2} = Handle(Long, convoy_inbox_core:new()),
    ?assertMatch([{deliver_run, 8192, Long}, {received, _, 8192}], A2),
    ?assertEqual(lists:seq(1, 8192), delivered(A2)),
    {C3, A3} = handle({slice, {Local, Cr}}, C2),
    ?assertEqual(lists:seq(8193, 10000), delivered(A3)),
    ?assertNot(convoy_inbox_core:busy(C3)).

%% A pid or alias of an old incarnation is counted, not sent to, in every kind
%% of entry; a barrier is answered in its place; bad entries are counted.
old_incarnation_and_barrier_test() ->
    Old = pid(?HERE, 1, ?C - 1),
    OldAlias = ref(?HERE, 1, ?C - 1),
    {_, A} = batch(a@h, [{Old, 1}, {[p(1), OldAlias], 2}, convoy_wire:barrier(pid(a@h, 1, 1), t),
                         convoy_wire:barrier(pid(b@h, 1, 1), t), {pid(b@h, 2, 1), 3}, {name, 4}],
                   new()),
    ?assertEqual([{rejected, undeliverable}, {deliver, p(1), 2}, {rejected, undeliverable},
                  {barrier, pid(a@h, 1, 1), t}, {rejected, bad_entry}, {rejected, bad_entry},
                  {deliver, name, 4}, {received, {tag, a@h}, 3}], A).

%% A message in pieces: its start asks for a monitor, then the room, then a
%% reservation of its size; its last piece delivers it in its place and gives
%% the room back. A start that does not fit, or whose reservation fails, is
%% refused (counted) and its monitor dropped.
pieces_test() ->
    Sender = pid(a@h, 5, 1),
    Ref = ref(a@h, 1, 1),
    Data = term_to_binary(whole),
    {First, Rest} = split_binary(Data, 3),
    Start = fun(R) -> convoy_wire:piece_start(R, Sender, p(1), term, byte_size(Data), First) end,
    {C1, [{deliver, _, before}, {monitor, Sender}]} = batch(a@h, [{p(1), before}, Start(Ref)], new()),
    Mon = make_ref(),
    {C2, [{room, a@h}]} = handle({monitored, Mon}, C1),
    {C3, [{reserve, a@h, 0, Size, 100}]} = handle({room, 100, 100}, C2),
    ?assertEqual(byte_size(Data), Size),
    {C4, A4} = handle({reserved, true}, C3),
    ?assertEqual([{piece_reply, Ref, 0}, {received, {tag, a@h}, 1}, {start_timer, 10}], A4),
    {C5, []} = handle({timer, make_ref()}, C4),
    ?assertMatch(#{partials := 1, held := #{a@h := Size}}, convoy_inbox_core:summary(C5)),
    {C6a, A6a} = batch(a@h, [convoy_wire:piece(Ref, 1, Rest), {p(1), 'after'}], C5),
    ?assertEqual([{release, a@h, 0}, {demonitor, Mon}, {assemble, term, [First, Rest]}], A6a),
    {C6, A6} = handle({assembled, {ok, whole}}, C6a),
    ?assertEqual([{deliver, p(1), whole}, {piece_reply, Ref, delivered},
                  {deliver, p(1), 'after'}, {received, {tag, a@h}, 2}], A6),
    ?assertMatch(#{partials := 0, held := #{}}, convoy_inbox_core:summary(C6)),
    %% no room
    Ref2 = ref(a@h, 2, 1),
    {C7, [{monitor, _}]} = batch(a@h, [Start(Ref2)], C6),
    {C8, [{room, a@h}]} = handle({monitored, Mon}, C7),
    {C9, A9} = handle({room, 3, 100}, C8),
    ?assertEqual([{demonitor, Mon}, {rejected, reassembly_full}, {piece_reply, Ref2, refused}], A9),
    %% room, but another inbox took it before the reservation
    Ref3 = ref(a@h, 3, 1),
    {C10, [{monitor, _}]} = batch(a@h, [Start(Ref3)], C9),
    {C11, [{room, a@h}]} = handle({monitored, Mon}, C10),
    {C12, [{reserve, a@h, 0, _, 100}]} = handle({room, 100, 100}, C11),
    {C13, A13} = handle({reserved, false}, C12),
    ?assertEqual([{demonitor, Mon}, {rejected, reassembly_full}, {piece_reply, Ref3, refused}], A13),
    ?assertMatch(#{partials := 0}, convoy_inbox_core:summary(C13)).

%% A node's messages in pieces take turns: the last piece of the one streaming
%% gives the next its turn, and that acknowledgement goes out before the
%% completed message is joined (a request: the copy of a large message takes
%% milliseconds, and the next message streams meanwhile). A join that fails is
%% counted and its sender still told.
turn_before_join_test() ->
    Data = term_to_binary(whole),
    {First, Rest} = split_binary(Data, 3),
    Start = fun(R, S) -> convoy_wire:piece_start(R, S, p(1), term, byte_size(Data), First) end,
    [R1, R2] = [ref(a@h, I, 1) || I <- [1, 2]],
    {C1, A1} = answered(batch(a@h, [Start(R1, pid(a@h, 5, 1))], new())),
    ?assert(lists:member({piece_reply, R1, 0}, A1)),
    {C2, A2} = answered(batch(a@h, [Start(R2, pid(a@h, 6, 1))], C1)),
    ?assertNot(lists:member({piece_reply, R2, 0}, A2)),
    {C3, A3} = batch(a@h, [convoy_wire:piece(R1, 1, Rest)], C2),
    ?assertMatch({assemble, term, [First, Rest]}, lists:last(A3)),
    ?assert(lists:member({piece_reply, R2, 0}, A3)),
    {_, A4} = handle({assembled, {ok, whole}}, C3),
    ?assertEqual([{deliver, p(1), whole}, {piece_reply, R1, delivered},
                  {received, {tag, a@h}, 1}], A4),
    {_, A5} = handle({assembled, error}, C3),
    ?assertEqual([{rejected, bad_piece}, {piece_reply, R1, delivered}], A5).

%% Answers the requests of a start (monitor, room, reservation, timer) until the
%% core asks for nothing; all the actions, requests left out.
answered({C, Actions}) ->
    answered(C, Actions, []).

answered(C, [], Acc) ->
    {C, Acc};
answered(C, Actions, Acc) ->
    Acc1 = Acc ++ lists:droplast(Actions),
    case lists:last(Actions) of
        {monitor, _} -> answered(handle({monitored, make_ref()}, C), Acc1);
        {room, _} -> answered(handle({room, infinity, infinity}, C), Acc1);
        {reserve, _, _, _, _} -> answered(handle({reserved, true}, C), Acc1);
        {start_timer, _} -> answered(handle({timer, make_ref()}, C), Acc1);
        Last -> {C, Acc1 ++ [Last]}
    end.

answered({C, Actions}, Acc) ->
    answered(C, Actions, Acc).

%% The partial of a sender whose monitor fires, or of a node that goes down, is
%% discarded, its room given back and its monitor dropped; a DOWN of another
%% monitor, or a tick of another timer, is counted and changes nothing.
discards_and_strays_test() ->
    Sender = pid(a@h, 5, 1),
    Ref = ref(a@h, 1, 1),
    Start = convoy_wire:piece_start(Ref, Sender, p(1), binary, 10, <<"abc">>),
    Mon = make_ref(),
    TRef = make_ref(),
    Held = fun(C) ->
                   {C1, [{monitor, Sender}]} = batch(a@h, [Start], C),
                   {C2, [{room, a@h}]} = handle({monitored, Mon}, C1),
                   {C3, [{reserve, a@h, 0, 10, infinity}]} =
                       handle({room, infinity, infinity}, C2),
                   {C4, _} = handle({reserved, true}, C3),
                   {C5, []} = handle({timer, TRef}, C4),
                   C5
           end,
    C0 = Held(new()),
    ?assertEqual({C0, [{rejected, unknown_message}]},
                 handle({down, make_ref(), Sender}, C0)),
    ?assertEqual({C0, [{rejected, unknown_message}]},
                 handle({tick, make_ref(), [], 1000}, C0)),
    Freed = [{release, a@h, 0}, {demonitor, Mon}, {rejected, partial_discarded}],
    {_, A1} = handle({down, Mon, Sender}, C0),
    ?assertEqual(Freed, A1),
    {_, A2} = handle({nodedown, a@h}, C0),
    ?assertEqual(Freed ++ [{forget, a@h}], A2),
    %% a sender no longer watching: marked at one tick, discarded at the next
    {C3, [{start_timer, 10}]} = handle({tick, TRef, [], 1000}, C0),
    {C4, []} = handle({timer, TRef}, C3),
    {_, A4} = handle({tick, TRef, [], 1000}, C4),
    ?assertEqual([{demonitor, Mon}, {rejected, partial_discarded}, {release, a@h, 0}], A4).

%% What sys:get_state/1 shows: unfinished batches with what is left of them.
summary_test() ->
    {C1, _} = batch(a@h, two_by_two(a, 4), new()),
    #{unfinished := #{a@h := [{{tag, a@h}, {multicast, _, {a, {3, _}}, _}, [_]}]}, partials := 0,
      held := #{}} = convoy_inbox_core:summary(C1).
