%% Properties of the inbox's pure core (convoy_inbox_core), without processes or
%% peers. Two nodes send streams of entries (sends, multicasts and publish
%% entries, some of large messages that need several slices, runs of them,
%% destinations of an old incarnation, barriers, bad entries, improper tails and
%% messages in pieces from two senders each) cut into batches; the batches are
%% interleaved at random with slices, senders killed, stray DOWNs and ticks,
%% nodedowns, ticks that sweep senders no longer watching, other inboxes taking
%% the shared bound's room (at times between a start's room and its
%% reservation). A small driver plays the inbox process: it carries out the
%% actions and answers the requests.
%%
%% Checked against a model that delivers every batch whole, entry by entry:
%% every message is delivered exactly once and in order per node and destination
%% (a message in pieces at its last piece, unless its start was refused or it
%% was discarded); each barrier is answered once everything before it is
%% delivered and nothing after it; the received and rejected counts are the
%% model's. After every step: the bytes this inbox and the others reserve for a
%% node never exceed the bound, what the partials hold is reserved, each held
%% partial has one monitor, and a tick is coming while partials are held. At the
%% end the senders abandon their messages (or die, or their node goes down):
%% every partial, reservation and monitor is freed.
-module(prop_convoy_inbox_core_tests).

-include_lib("proper/include/proper.hrl").
-include_lib("eunit/include/eunit.hrl").

-define(HERE, 'here@h').
-define(CREATION, 7).
-define(NODES, ['a@h', 'b@h']).
-define(BARRIER_TIMEOUT, 100).

inbox_core_test_() ->
    {timeout, 600,
     fun() ->
             ?assertEqual(ok, convoy_prop:check(prop_inbox_core(),
                                                [{numtests, 10000}, {to_file, user}]))
     end}.

%%--------------------------------------------------------------------
%% Generators

node_gen() -> oneof(?NODES).

sender_gen() -> oneof([1, 2]).

dest_gen() -> frequency([{3, p1}, {3, p2}, {2, p3}, {2, a1}, {1, o1}, {1, o2}, {1, n1}]).

big_gen() -> frequency([{3, false}, {2, true}]).

item() ->
    frequency([{6, {send, dest_gen()}},
               {3, {mc, oneof([l1, l2, l3, l4, l5, l6]), big_gen()}},
               {3, {pub, oneof([{s, g1}, {s, g2}, {s, g3}, {nos, g1}]), big_gen()}},
               {2, barrier},
               {1, {bad, oneof([dest, barrier])}},
               {2, {start, sender_gen(), range(1, 4), range(0, 300), dest_gen(), range(1, 3)}},
               {6, {next, sender_gen()}}]).

%% A node's entries, the sizes of its batches and which batches end improper.
stream() ->
    {list(item()), list(range(1, 8)), list(frequency([{9, false}, {1, true}]))}.

cmd() ->
    frequency([{10, {batch, node_gen()}},
               {6, slice},
               {1, {kill, node_gen(), sender_gen()}},
               {1, {stray_down, node_gen(), sender_gen()}},
               {1, {nodedown, node_gen()}},
               {3, {tick, vector(4, frequency([{4, false}, {1, true}]))}},
               {1, stray_tick},
               {1, {others, node_gen(), range(0, 1500)}}]).

prop_inbox_core() ->
    ?FORALL({Bound, Streams, Cmds, Races, End},
            {oneof([infinity, range(100, 1500)]), vector(2, stream()), list(cmd()),
             list(frequency([{4, false}, {1, true}])), oneof([sweep, down, nodedown])},
            begin
                Result = try run(Bound, lists:zip(?NODES, Streams), Cmds, Races, End)
                         catch C:R:St -> {crashed, C, R, St}
                         end,
                ?WHENFAIL(io:format(user, "~nbound ~p, end ~p~nresult ~P~n", [Bound, End, Result, 60]),
                          Result =:= ok)
            end).

%%--------------------------------------------------------------------
%% Identities

%% A pid or reference of Node with the given creation (NEW_PID_EXT,
%% NEWER_REFERENCE_EXT).
pid(Node, Id, Creation) -> convoy_test_ids:pid(Node, Id, Creation).

ref(Node, Id, Creation) -> convoy_test_ids:ref(Node, Id, Creation).

dest(p1) -> pid(?HERE, 1, ?CREATION);
dest(p2) -> pid(?HERE, 2, ?CREATION);
dest(p3) -> pid(?HERE, 3, ?CREATION);
dest(a1) -> ref(?HERE, 1, ?CREATION);
dest(o1) -> pid(?HERE, 9, ?CREATION - 1);
dest(o2) -> ref(?HERE, 9, ?CREATION - 1);
dest(n1) -> a_name.

old(To) -> To =:= dest(o1) orelse To =:= dest(o2).

dests(l1) -> [p1, p2, p3];
dests(l2) -> [p1, o1, a1];
dests(l3) -> [p2, p2];
dests(l4) -> [n1, p3];
dests(l5) -> [];
dests(l6) -> [p1].

members(s, g1) -> {ok, [dest(p1), dest(p2), dest(p3)]};
members(s, g2) -> {ok, [dest(p2), dest(p2)]};
members(s, g3) -> {ok, []};
members(_, _) -> no_scope.

sender(Node, S) -> pid(Node, 100 + S, 1).

%% A message of 60,000 words: a few such entries take a slice.
msg(Node, Seq, true) -> {Node, Seq, big()};
msg(Node, Seq, false) -> {Node, Seq}.

big() ->
    case get(big) of
        undefined -> B = lists:seq(1, 30000), put(big, B), B;
        B -> B
    end.

%%--------------------------------------------------------------------
%% Streams to entries: each entry with a note for the model (`{piece, Ref,
%% Last}' for a piece of a message in pieces)

expand(Node, Items) ->
    {Entries, _} = lists:foldl(fun(Item, {Acc, {Seq, Open, NextRef}}) ->
                                       {Es, State} = expand(Node, Item, Seq, Open, NextRef),
                                       {lists:reverse(Es, Acc), State}
                               end, {[], {1, #{}, 1}}, Items),
    lists:reverse(Entries).

expand(Node, {send, D}, Seq, Open, R) ->
    {[{{dest(D), msg(Node, Seq, false)}, none}], {Seq + 1, Open, R}};
expand(Node, {mc, L, Big}, Seq, Open, R) ->
    {[{{[dest(D) || D <- dests(L)], msg(Node, Seq, Big)}, none}], {Seq + 1, Open, R}};
expand(Node, {pub, {Scope, Group}, Big}, Seq, Open, R) ->
    {[{convoy_wire:publish(Scope, Group, msg(Node, Seq, Big)), none}], {Seq + 1, Open, R}};
expand(Node, barrier, Seq, Open, R) ->
    {[{convoy_wire:barrier(pid(Node, 99, 1), Seq), none}], {Seq + 1, Open, R}};
expand(Node, {bad, dest}, Seq, Open, R) ->
    {[{{pid('other@h', 1, 1), msg(Node, Seq, false)}, none}], {Seq + 1, Open, R}};
expand(_Node, {bad, barrier}, Seq, Open, R) ->
    {[{convoy_wire:barrier(pid('other@h', 2, 1), Seq), none}], {Seq + 1, Open, R}};
expand(Node, {start, S, NParts, Pad, D, AckEvery}, Seq, Open, R) ->
    %% A new message of sender S (its previous one, if unfinished, abandoned).
    Ref = ref(Node, R, 1),
    Whole = {{Node, Seq, piece, binary:copy(<<"x">>, Pad)}, dest(D)},
    Data = term_to_binary(element(1, Whole)),
    {Size, [First | Parts]} = convoy_chunk:pieces(Data, max(1, -(-byte_size(Data) div NParts))),
    Start = convoy_wire:piece_start(Ref, sender(Node, S), dest(D), term, Size, AckEvery, First),
    {[{Start, {piece, Ref, last(Parts, Whole)}}],
     {Seq + 1, Open#{S => {Ref, 1, Parts, Whole}}, R + 1}};
expand(_Node, {next, S}, Seq, Open, R) ->
    case Open of
        #{S := {Ref, I, [Part | Parts], Whole}} ->
            {[{convoy_wire:piece(Ref, I, Part), {piece, Ref, last(Parts, Whole)}}],
             {Seq, Open#{S := {Ref, I + 1, Parts, Whole}}, R}};
        _ ->
            {[], {Seq, Open, R}}
    end.

%% The last piece completes the message: its message and destination.
last([], Whole) -> Whole;
last(_Parts, _Whole) -> false.

%% Entries cut into batches of the given sizes (4 once they run out); a batch
%% flagged improper ends in a tail that is not a list.
batches([], _Sizes, _Improper) ->
    [];
batches(Entries, Sizes, Improper) ->
    {N, Sizes1} = case Sizes of
                      [H | T] -> {H, T};
                      [] -> {4, []}
                  end,
    {Bad, Improper1} = case Improper of
                           [B | Bs] -> {B, Bs};
                           [] -> {false, []}
                       end,
    {Batch, Rest} = lists:split(min(N, length(Entries)), Entries),
    Es = [E || {E, _} <- Batch],
    [case Bad of
         true -> lists:foldr(fun(E, Acc) -> [E | Acc] end, improper_tail, Es);
         false -> Es
     end | batches(Rest, Sizes1, Improper1)].

%%--------------------------------------------------------------------
%% The driver

run(Bound, Streams, Cmds, Races, End) ->
    Planned = [{Node, expand(Node, Items), Sizes, Improper}
               || {Node, {Items, Sizes, Improper}} <- Streams],
    St0 = #{core => convoy_inbox_core:new(), bound => Bound, races => Races,
            queues => maps:from_list([{Node, batches(Es, Sizes, Imp)}
                                      || {Node, Es, Sizes, Imp} <- Planned]),
            starts => starts(Planned), senders => senders(Planned), lasts => lasts(Planned), current => #{}, fed => #{},
            others => #{}, ours => #{}, mons => #{}, dead => #{}, downs => [],
            timer => none, log => #{}, count => #{}, barriers => [], received => #{},
            rejected => #{}, stray => 0, refused => #{}, discarded => #{}, last => none},
    St1 = lists:foldl(fun cmd/2, St0, Cmds),
    St2 = drain(feed_all(St1), 100000),
    ok = compare(Planned, St2),
    free(End, St2).

%% Per message in pieces sent in full, the sequence number of its last piece.
lasts(Planned) ->
    maps:from_list([{Ref, seq(E)} || {_, Es, _, _} <- Planned, {E, {piece, Ref, {_, _}}} <- Es]).

seq({'$convoy_piece', _Ref, Seq, _Data}) -> Seq;
seq({'$convoy_piece', _Ref, 0, _Data, _Info}) -> 0.

senders(Planned) ->
    maps:from_list([{Ref, element(1, Info)} || {_, Es, _, _} <- Planned,
                                               {{'$convoy_piece', Ref, 0, _, Info}, _} <- Es]).

%% Per sender, its messages' references in the order of their starts.
starts(Planned) ->
    lists:foldl(fun({Start, _}, Acc) ->
                        {'$convoy_piece', Ref, 0, _, Info} = Start,
                        Sender = element(1, Info),
                        maps:update_with(Sender, fun(L) -> L ++ [Ref] end, [Ref], Acc)
                end, #{}, [E || {_, Es, _, _} <- Planned,
                                {{'$convoy_piece', _, 0, _, _}, _} = E <- Es]).

cmd(Cmd, St) ->
    St1 = downs(command(Cmd, St)),
    ok = check(St1),
    St1.

command({batch, Node}, St = #{queues := Qs}) ->
    case Qs of
        #{Node := [B | Bs]} ->
            input({batch, Node, Node, B, {?HERE, ?CREATION}}, sent(B, St#{queues := Qs#{Node := Bs}}));
        _ -> St
    end;
command(slice, St) ->
    input({slice, {?HERE, ?CREATION}}, St);
command({kill, Node, S}, St = #{dead := Dead, mons := Mons, downs := Downs}) ->
    Pid = sender(Node, S),
    Fired = [M || {M, {P, _}} <- maps:to_list(Mons), P =:= Pid],
    St#{dead := Dead#{Pid => true}, downs := Downs ++ Fired};
command({stray_down, Node, S}, St = #{stray := N}) ->
    input({down, make_ref(), sender(Node, S)}, St#{stray := N + 1});
command({nodedown, Node}, St) ->
    input({nodedown, Node}, St);
command({tick, Extra}, St = #{timer := TRef, discarded := D0}) when is_reference(TRef) ->
    %% A sender monitors the inbox while it has pieces of its message still to
    %% send, and some for another reason (Extra).
    Senders = [sender(N, S) || N <- ?NODES, S <- [1, 2]],
    Watching = [P || {P, X} <- lists:zip(Senders, Extra), X orelse sending(P, St)],
    St1 = #{discarded := D1} = input({tick, TRef, Watching, ?BARRIER_TIMEOUT}, St#{timer := none}),
    %% A sweep never discards a message its live sender sent in full.
    [throw({swept_whole_message, Ref}) || Ref <- maps:keys(D1) -- maps:keys(D0),
                                          is_map_key(Ref, maps:get(lasts, St)),
                                          not is_map_key(sender_of(Ref, St), maps:get(dead, St))],
    St1;
command({tick, _}, St) ->
    St;
command(stray_tick, St = #{stray := N}) ->
    input({tick, make_ref(), [], ?BARRIER_TIMEOUT}, St#{stray := N + 1});
command({others, Node, Bytes}, St = #{bound := infinity, others := O}) ->
    St#{others := O#{Node => Bytes}};
command({others, Node, Bytes}, St = #{bound := B, others := O, ours := Ours}) ->
    St#{others := O#{Node => min(Bytes, B - maps:get(Node, Ours, 0))}}.

%% A batch handed in: the starts and last pieces it carries.
sent(Batch, St) ->
    sent_entries(Batch, St).

sent_entries([{'$convoy_piece', Ref, 0, _, Info} = E | Rest], St = #{current := Cur}) ->
    sent_entries(Rest, last_sent(E, Ref, St#{current := Cur#{element(1, Info) => Ref}}));
sent_entries([{'$convoy_piece', Ref, _, _} = E | Rest], St) ->
    sent_entries(Rest, last_sent(E, Ref, St));
sent_entries([_ | Rest], St) ->
    sent_entries(Rest, St);
sent_entries(_, St) ->
    St.

last_sent(E, Ref, St = #{lasts := Lasts, fed := Fed}) ->
    case Lasts of
        #{Ref := Last} -> case seq(E) of
                              Last -> St#{fed := Fed#{Ref => true}};
                              _ -> St
                          end;
        _ -> St
    end.

%% Whether a live sender still has pieces of its message to send.
sending(P, #{current := Cur, lasts := Lasts, fed := Fed, dead := Dead}) ->
    case Cur of
        #{P := Ref} -> is_map_key(Ref, Lasts) andalso not is_map_key(Ref, Fed)
                           andalso not is_map_key(P, Dead);
        _ -> false
    end.

sender_of(Ref, #{senders := Senders}) -> maps:get(Ref, Senders).

%% DOWNs of monitors of dead senders, as they would come next.
downs(St = #{downs := []}) ->
    St;
downs(St = #{downs := [Mon | Rest], mons := Mons}) ->
    {Pid, _} = maps:get(Mon, Mons),
    St1 = input({down, Mon, Pid}, St#{downs := Rest}),
    not is_map_key(Mon, maps:get(mons, St1)) orelse throw({down_kept, Mon}),
    downs(St1).

feed_all(St = #{queues := Qs}) ->
    case [N || {N, [_ | _]} <- maps:to_list(Qs)] of
        [] -> St;
        Nodes -> feed_all(lists:foldl(fun(N, Acc) -> cmd({batch, N}, Acc) end, St, Nodes))
    end.

drain(St, 0) ->
    throw({never_finished, convoy_inbox_core:summary(maps:get(core, St))});
drain(St = #{core := C}, K) ->
    case convoy_inbox_core:busy(C) of
        true -> drain(cmd(slice, St), K - 1);
        false -> St
    end.

input(Input, St = #{core := C}) ->
    {C1, Actions} = convoy_inbox_core:handle(Input, C),
    acts(Actions, St#{core := C1}).

acts([], St) -> St;
acts([{deliver_plain, Entries, Max, Good, Local}], St) ->
    %% as the shell: the run's sends, in the walk that checks them
    {K, Rest, Good1, 0} = convoy_plain:run(Entries, Max, Good, Local, count),
    St1 = lists:foldl(fun({To, Msg}, Acc) -> log(To, Msg, Acc) end, St,
                      lists:sublist(Entries, K)),
    input({delivered_plain, K, Rest, Good1}, St1);
acts([{members, Scope, Group}], St) -> input({members, members(Scope, Group)}, St);
acts([{monitor, Pid}], St = #{starts := Starts, mons := Mons, dead := Dead, downs := Downs}) ->
    %% Starts of a sender come in order: this is its next one.
    [Ref | Refs] = maps:get(Pid, Starts),
    Mon = make_ref(),
    St1 = St#{starts := Starts#{Pid := Refs}, mons := Mons#{Mon => {Pid, Ref}},
              downs := case Dead of
                           #{Pid := _} -> Downs ++ [Mon]; % monitoring the dead: DOWN at once
                           _ -> Downs
                       end},
    input({monitored, Mon}, St1);
acts([{room, Node}], St = #{bound := Bound, others := O}) ->
    Room = case Bound of
               infinity -> infinity;
               _ -> max(0, Bound - maps:get(Node, O, 0))
           end,
    input({room, Room, Bound}, St);
acts([{reserve, Node, Old, Held, Bound}], St = #{bound := Bound, ours := Ours, others := O0,
                                                 races := Races}) ->
    Old =:= maps:get(Node, Ours, 0) orelse throw({reserve_old, Node, Old, Ours}),
    Held > Old orelse throw({reserve_not_more, Node, Old, Held}),
    %% Another inbox may take the room between the start's room and this.
    {O, Races1} = case {Races, Bound} of
                      {[true | Rs], B} when is_integer(B) -> {O0#{Node => B - Old}, Rs};
                      {[_ | Rs], _} -> {O0, Rs};
                      {[], _} -> {O0, []}
                  end,
    Fits = Bound =:= infinity orelse maps:get(Node, O, 0) + Held =< Bound,
    Ours1 = case Fits of
                true -> Ours#{Node => Held};
                false -> Ours
            end,
    input({reserved, Fits}, St#{ours := Ours1, others := O, races := Races1});
acts([{assemble, Kind, Parts}], St) ->
    input({assembled, convoy_chunk:assemble(Kind, Parts)}, St);
acts([{start_timer, _Ms}], St = #{timer := none}) ->
    TRef = make_ref(),
    input({timer, TRef}, St#{timer := TRef});
acts([A | Rest], St) ->
    acts(Rest, (act(A, St))#{last := A}).

act({deliver, To, Msg}, St) ->
    log(To, Msg, St);
act({deliver_each, Tos, Msg}, St) ->
    lists:foldl(fun(To, Acc) -> log(To, Msg, Acc) end, St, Tos);
act({deliver_all, To, Msgs}, St) ->
    lists:foldl(fun(M, Acc) -> log(To, M, Acc) end, St, Msgs);
act({publish, Members, Msgs}, St) ->
    lists:foldl(fun(P, Acc) -> lists:foldl(fun(M, Acc1) -> log(P, M, Acc1) end, Acc, Msgs) end,
                St, [P || P <- Members, is_pid(P), node(P) =:= ?HERE]);
act({barrier, ReplyTo, Tag}, St = #{barriers := Bs, count := Count}) ->
    Node = node(ReplyTo),
    St#{barriers := [{Node, Tag, maps:get(Node, Count, 0)} | Bs]};
act({piece_reply, Ref, refused}, St = #{refused := R}) ->
    St#{refused := R#{Ref => true}};
act({piece_reply, _Ref, _What}, St) ->
    St;
act({demonitor, Mon}, St = #{mons := Mons, downs := Downs}) ->
    is_map_key(Mon, Mons) orelse throw({demonitor_unknown, Mon}),
    St#{mons := maps:remove(Mon, Mons), downs := Downs -- [Mon], gone => maps:get(Mon, Mons)};
act({release, Node, Held}, St = #{ours := Ours}) ->
    Held < maps:get(Node, Ours, 0) orelse throw({release_not_less, Node, Held, Ours}),
    St#{ours := Ours#{Node => Held}};
act({forget, Node}, St = #{ours := Ours}) ->
    maps:get(Node, Ours, 0) =:= 0 orelse throw({forget_reserved, Node, Ours}),
    St;
act({received, Node, N}, St = #{received := R}) ->
    St#{received := maps:update_with(Node, fun(K) -> K + N end, N, R)};
act({rejected, partial_discarded} = A, St = #{last := {demonitor, _}, gone := {_, Ref},
                                             discarded := D}) ->
    count(A, St#{discarded := D#{Ref => true}});
act({rejected, partial_discarded}, St) ->
    throw({discarded_without_demonitor, maps:get(last, St)});
act({rejected, _} = A, St) ->
    count(A, St).

count({rejected, Kind}, St = #{rejected := R}) ->
    St#{rejected := maps:update_with(Kind, fun(K) -> K + 1 end, 1, R)}.

log(To, Msg, St = #{log := Log, count := Count}) ->
    Node = element(1, Msg),
    St#{log := maps:update_with(Node, fun(L) -> [{To, element(2, Msg)} | L] end,
                                [{To, element(2, Msg)}], Log),
        count := maps:update_with(Node, fun(K) -> K + 1 end, 1, Count)}.

%% After every step.
check(#{core := C, bound := Bound, ours := Ours, others := O, mons := Mons, timer := T}) ->
    #{partials := Partials, held := Held, unfinished := Unfinished} = convoy_inbox_core:summary(C),
    [throw({over_bound, N, Bytes, maps:get(N, O, 0), Bound})
     || is_integer(Bound), {N, Bytes} <- maps:to_list(Ours), Bytes + maps:get(N, O, 0) > Bound],
    [throw({held_not_reserved, N, H, Ours}) || {N, H} <- maps:to_list(Held), H > maps:get(N, Ours, 0)],
    map_size(Mons) =:= Partials orelse throw({monitors, map_size(Mons), partials, Partials}),
    Partials =:= 0 orelse is_reference(T) orelse throw({no_tick, Partials}),
    convoy_inbox_core:busy(C) =:= (map_size(Unfinished) > 0) orelse throw({busy, Unfinished}),
    ok.

%%--------------------------------------------------------------------
%% The model: every batch delivered whole, entry by entry

compare(Planned, St = #{log := Log, barriers := Barriers, received := Received,
                        rejected := Rejected, refused := Refused, discarded := Discarded}) ->
    Failed = maps:merge(Refused, Discarded),
    Models = [{Node, model(Node, Es, length([x || true <- lists:sublist(Imp, nbatches(Es, Sizes))]),
                           Failed)}
              || {Node, Es, Sizes, Imp} <- Planned],
    lists:foreach(
      fun({Node, #{log := Expected, barriers := Bs, received := R}}) ->
              Got = lists:reverse(maps:get(Node, Log, [])),
              Dests = lists:usort([D || {D, _} <- Expected ++ Got]),
              [throw({order, Node, D, got, Sub(Got), expected, Sub(Expected)})
               || D <- Dests, Sub <- [fun(L) -> [S || {To, S} <- L, To =:= D] end],
                  Sub(Got) =/= Sub(Expected)],
              Answered = lists:sort([{Tag, K} || {N, Tag, K} <- Barriers, N =:= Node]),
              Answered =:= lists:sort(Bs) orelse throw({barriers, Node, Answered, Bs}),
              R =:= maps:get(Node, Received, 0)
                  orelse throw({received, Node, maps:get(Node, Received, 0), R})
      end, Models),
    Sum = fun(K) -> lists:sum([maps:get(K, M, 0) || {_, #{rejected := M}} <- Models]) end,
    Expected = #{bad_entry => Sum(bad_entry), undeliverable => Sum(undeliverable),
                 malformed_batch => Sum(malformed_batch), unknown_message => maps:get(stray, St),
                 reassembly_full => map_size(Refused), partial_discarded => map_size(Discarded),
                 too_costly => 0},
    Got = maps:with(maps:keys(Expected), maps:merge(maps:map(fun(_, _) -> 0 end, Expected), Rejected)),
    Got =:= Expected orelse throw({rejected, Got, expected, Expected}),
    maps:get(bad_piece, Rejected, 0) =< Sum(failed_pieces)
        orelse throw({bad_piece, Rejected, Sum(failed_pieces)}),
    ok.

nbatches(Es, Sizes) ->
    length(batches(Es, Sizes, [])).

model(Node, Entries, Improper, Failed) ->
    M0 = #{log => [], count => 0, barriers => [], received => 0,
           rejected => #{malformed_batch => Improper}},
    M = lists:foldl(fun(E, M1) -> model_entry(Node, E, Failed, M1) end, M0, Entries),
    M#{log := lists:reverse(maps:get(log, M))}.

model_entry(Node, {E, Note}, Failed, M) ->
    case {convoy_wire:entry(E, Node, ?HERE), Note} of
        {{deliver, To, Msg}, none} ->
            received(sends([To], Msg, M));
        {{multicast, Tos, Msg, _}, none} ->
            received(sends(Tos, Msg, M));
        {{publish, Scope, Group, Msg}, none} ->
            case members(Scope, Group) of
                {ok, Members} -> received(sends(Members, Msg, M));
                no_scope -> reject(undeliverable, M)
            end;
        {{barrier, _, Tag}, none} ->
            M#{barriers := [{Tag, maps:get(count, M)} | maps:get(barriers, M)]};
        {{error, Kind}, none} ->
            reject(Kind, M);
        {_Piece, {piece, Ref, Last}} ->
            case {is_map_key(Ref, Failed), Last} of
                {true, _} -> reject(failed_pieces, M);
                {false, {Msg, To}} -> received(sends([To], Msg, M));
                {false, false} -> M
            end
    end.

sends(Tos, Msg, M) ->
    lists:foldl(fun(To, M1) ->
                        case old(To) of
                            true -> reject(undeliverable, M1);
                            false -> M1#{log := [{To, element(2, Msg)} | maps:get(log, M1)],
                                         count := maps:get(count, M1) + 1}
                        end
                end, M, Tos).

received(M = #{received := R}) -> M#{received := R + 1}.

reject(Kind, M = #{rejected := R}) ->
    M#{rejected := maps:update_with(Kind, fun(K) -> K + 1 end, 1, R)}.

%%--------------------------------------------------------------------
%% The end: every partial, reservation and monitor freed

free(sweep, St) ->
    %% No sender watches the inbox: marked at one tick, discarded at the next.
    finished(tick_all(tick_all(St)));
free(down, St = #{mons := Mons}) ->
    finished(downs(St#{downs := maps:keys(Mons)}));
free(nodedown, St) ->
    finished(lists:foldl(fun(N, Acc) -> cmd({nodedown, N}, Acc) end, St, ?NODES)).

tick_all(St = #{timer := T}) when is_reference(T) -> cmd({tick, [false, false, false, false]}, St);
tick_all(St) -> St.

finished(#{core := C, ours := Ours, mons := Mons}) ->
    #{partials := P, held := H} = convoy_inbox_core:summary(C),
    {P, H, [N || {N, B} <- maps:to_list(Ours), B > 0], Mons} =:= {0, #{}, [], #{}}
        orelse throw({not_freed, P, H, Ours, Mons}),
    ok.
