%% PropEr properties of `convoy_chunk', run from EUnit.
%%
%% Cutting: any term or binary, cut at any piece size, comes back whole and the
%% pieces have the size asked (the last one at most); so does a large binary in
%% tuples, sent as a skeleton and a binary (kind `path') to a peer that reads
%% them, encoded whole to one that does not.
%%
%% Reassembly: several senders each send messages one after another, as pieces
%% (cut by `pieces/2'); their streams are interleaved at random, with faults: a
%% piece lost (a gap), a piece or start repeated, a sender killed part way (its
%% `down' comes then, its later messages are never sent), a sender giving up
%% part way (it goes on with its next message), forged pieces (unknown
%% references, or known ones with sequence numbers far out of range; a `DOWN'
%% naming a sender with a reference that is not its message's monitor), a bound on
%% the bytes held, and at the end the node's `nodedown'. A model of what must
%% happen (a start is refused if its size does not fit beside what is held; a
%% message completes when all its pieces came in sequence after an accepted
%% start; a sender's new start or death discards its message in progress) says
%% which messages are delivered: exactly those, byte for byte, in that order
%% (so in order per sender and never twice), every non-ack result is counted
%% where the model expects it, the bytes held always equal the model's and
%% never exceed the bound, and nothing is held after the nodedown. Each message
%% asks for an acknowledgement every 1 to 4 pieces: the start and exactly the
%% pieces that interval names are acknowledged, the others only stored.
%% Turns: messages of the node take turns, so a start whose node has a message
%% streaming is stored and its acknowledgement comes later (`take_granted/1'),
%% in the order the starts came, when the streaming message completes or is
%% discarded, or at a tick (inserted at random, with a patience of 1 to 3 ticks)
%% where the streaming one took no piece since the tick before (one tick after
%% its turn came at the earliest) or a start has waited its patience. The model
%% says which starts are granted at each step: exactly those, in that order.
%% Senders that moved on: a sender monitors the inbox from its start until it
%% is done with the message (all its pieces sent, or given up); sweeps
%% (inserted at random, the node busy or not) mark the messages of senders not
%% monitoring and discard, at the next sweep with the node not busy, those
%% marked and still incomplete, exactly as the model says.
%% PropEr 1.2 cannot report an exception raised inside a property on OTP 25, so
%% the properties catch and print their own.
-module(prop_convoy_chunk_tests).

-export([prop_cut/0, prop_reassembly/0]).

-include_lib("proper/include/proper.hrl").
-include_lib("eunit/include/eunit.hrl").

-define(NODE, n@host).

cut_test_() ->
    {timeout, 120,
     ?_assertEqual(ok, convoy_prop:check(prop_cut(), [{numtests, 2000}, {to_file, user}]))}.

reassembly_test_() ->
    {timeout, 300,
     ?_assertEqual(ok, convoy_prop:check(prop_reassembly(),
                                         [{numtests, 3000}, {to_file, user}, {max_shrinks, 200}]))}.

%%--------------------------------------------------------------------
%% Cutting

prop_cut() ->
    ?FORALL({Msg, N, Paths},
            oneof([{oneof([binary(), any(), {binary(), [binary()], any()}]), range(1, 70),
                    boolean()},
                   {enveloped(), range(1000, 70000), boolean()}]),
            begin
                {Kind, Data} = convoy_chunk:payload(Msg, Paths),
                {Size, Pieces} = convoy_chunk:pieces(Data, N),
                Whole = iolist_to_binary(Pieces),
                Sizes = [byte_size(P) || P <- Pieces],
                Size =:= iolist_size(Data)
                    andalso Whole =:= iolist_to_binary(Data)
                    andalso lists:all(fun(S) -> S =:= N end, lists:droplast([N | Sizes]))
                    andalso lists:all(fun(S) -> S > 0 andalso S =< N end, Sizes)
                    andalso convoy_chunk:assemble(Kind, Pieces) =:= {ok, Msg}
                    andalso (Paths orelse not is_tuple(Kind))
            end).

%% A binary of at least 64 KiB (where a peer that reads paths gets one), in
%% tuples 1 to 4 deep (the 4th too deep for a path) of at most 15 elements,
%% beside other terms.
enveloped() ->
    ?LET({Seed, Depth}, {non_empty(binary()), range(1, 4)},
         wrap(Depth, binary:copy(Seed, 65536 div byte_size(Seed) + 1))).

wrap(0, Inner) ->
    Inner;
wrap(Depth, Inner) ->
    ?LET({Before, After}, {short_list(), short_list()},
         ?LET(T, wrap(Depth - 1, Inner), list_to_tuple(Before ++ [T | After]))).

short_list() ->
    ?LET(L, list(oneof([atom(), integer(), binary(), {binary()}])), lists:sublist(L, 7)).

%%--------------------------------------------------------------------
%% Reassembly

prop_reassembly() ->
    ?FORALL(Case, scenario(),
            begin
                Result = try run(Case) catch C:R:St -> {crashed, C, R, St} end,
                ?WHENFAIL(io:format(user, "~P~n=> ~P~n", [Case, 40, Result, 40]),
                          Result =:= true)
            end).

%% {Bound, PieceBytes, Plans, Order, Forged, Patience}: per sender a list of
%% messages (payload, fault); Order: which sender's stream takes the next step;
%% Forged: where forged entries and ticks go; Patience: ticks a start waits at most.
scenario() ->
    {oneof([infinity, range(20, 400)]),
     range(1, 40),
     non_empty(list(list({binary(), fault(), range(1, 4)}))),
     list(range(1, 4)),
     list({range(0, 200), oneof([forged(), tick, {sweep, boolean()}])}),
     range(1, 3)}.

fault() ->
    frequency([{6, none}, {1, {gap, range(0, 6)}}, {1, {dup, range(0, 6)}},
               {1, {kill, range(0, 6)}}, {1, {give_up, range(1, 6)}}]).

forged() ->
    oneof([unknown_ref, {known_ref, range(1000, 2000)}, known_start, known_down]).

run({Bound, N, Plans, Order, Forged, Patience}) ->
    Senders = [{S, spawn(fun() -> ok end)} || S <- lists:seq(1, length(Plans))],
    Streams = [{Pid, stream(Pid, Msgs, N)} || {{_, Pid}, Msgs} <- lists:zip(Senders, Plans)],
    Events0 = interleave(Streams, Order),
    Events = insert_forged(Events0, Forged, known_refs(Events0)),
    {Delivered, Rx, Model} = lists:foldl(fun(E, Acc) -> step(E, {Bound, Patience}, Acc) end,
                                         {[], convoy_chunk:new(), model()}, Events),
    Expected = lists:reverse(maps:get(delivered, Model)),
    {_, RxEnd} = convoy_chunk:nodedown(?NODE, Rx),
    lists:reverse(Delivered) =:= Expected
        orelse throw({delivered, lists:reverse(Delivered), expected, Expected}),
    convoy_chunk:held(?NODE, RxEnd) =:= 0 andalso convoy_chunk:partials(RxEnd) =:= 0.

%% A sender's events: each message's start and pieces, with its fault, then
%% `unwatch' (it drops its monitor of the inbox, done with the message); after a
%% kill nothing more of this sender, then its down; after giving up (its first I
%% entries sent) it goes on with its next message.
stream(Pid, Msgs, N) ->
    stream(Pid, Msgs, N, []).

stream(_Pid, [], _N, Acc) ->
    lists:reverse(Acc);
stream(Pid, [{Payload, Fault, AckEvery} | Rest], N, Acc) ->
    Ref = make_ref(),
    {Size, Pieces} = convoy_chunk:pieces(Payload, N),
    Entries = case Pieces of
                  [] -> [];
                  [First | More] ->
                      [{start, Pid, Ref, Size, First, Payload, AckEvery}
                       | [{piece, Pid, Ref, Seq, P} || {Seq, P} <- lists:zip(lists:seq(1, length(More)), More)]]
              end,
    Unwatch = [{unwatch, Pid} || Entries =/= []],
    case Fault of
        {kill, I} when I < length(Entries) ->
            lists:reverse(Acc, lists:sublist(Entries, I) ++ [{down, Pid}]);
        {gap, I} when I < length(Entries) ->
            stream(Pid, Rest, N, lists:reverse(drop_nth(I, Entries) ++ Unwatch, Acc));
        {dup, I} when I < length(Entries) ->
            stream(Pid, Rest, N, lists:reverse(dup_nth(I, Entries) ++ Unwatch, Acc));
        {give_up, I} when I < length(Entries) ->
            stream(Pid, Rest, N, lists:reverse(lists:sublist(Entries, I) ++ Unwatch, Acc));
        _ ->
            stream(Pid, Rest, N, lists:reverse(Entries ++ Unwatch, Acc))
    end.

drop_nth(I, L) -> lists:sublist(L, I) ++ tl(lists:nthtail(I, L)).
dup_nth(I, L) -> lists:sublist(L, I + 1) ++ [lists:nth(I + 1, L)] ++ lists:nthtail(I + 1, L).

%% Merge the streams: Order picks whose next event comes; then the rest in turn.
interleave(Streams, Order) ->
    interleave(list_to_tuple([S || {_, S} <- Streams]), Order, []).

interleave(T, [], Acc) ->
    lists:reverse(Acc, lists:append(tuple_to_list(T)));
interleave(T, [I | Order], Acc) ->
    K = (I - 1) rem tuple_size(T) + 1,
    case element(K, T) of
        [] -> interleave(T, Order, Acc);
        [E | Rest] -> interleave(setelement(K, T, Rest), Order, [E | Acc])
    end.

known_refs(Events) ->
    [{Pid, Ref, Size} || {start, Pid, Ref, Size, _, _, _} <- Events].

insert_forged(Events, [], _Known) ->
    Events;
insert_forged(Events, [{At, F} | Rest], Known) ->
    {Before, After} = lists:split(min(At, length(Events)), Events),
    insert_forged(Before ++ [forge(F, Known)] ++ After, Rest, Known).

forge(tick, _Known) ->
    tick;
forge({sweep, Busy}, _Known) ->
    {sweep, Busy};
forge(unknown_ref, _Known) ->
    {forged_piece, make_ref(), 1, <<"f">>};
forge({known_ref, Seq}, [{_, Ref, _} | _]) ->
    {forged_piece, Ref, Seq, <<"f">>};
forge(known_start, [{Pid, Ref, Size} | _]) ->
    %% a repeated start of a known message, sized as it was: in progress or
    %% completed, it is rejected; discarded, it starts again (and never
    %% completes: its pieces are past)
    {forged_start, Pid, Ref, Size};
forge(known_down, [{Pid, _, _} | _]) ->
    {forged_down, Pid};
forge(_, []) ->
    {forged_piece, make_ref(), 1, <<"f">>}.

%%--------------------------------------------------------------------
%% The model and one step of both

%% cur: per sender its message in progress (`left': marked by a sweep);
%% watching: the senders monitoring the inbox; active: the message whose turn it
%% is ({Ref, next piece at the last tick, or fresh}) or none; queue: starts
%% waiting for their turn, oldest first, with the ticks waited; granted: turns
%% given in this step.
model() ->
    #{held => 0, cur => #{}, refs => #{}, delivered => [], active => none, queue => [],
      granted => [], watching => #{}}.

step(tick, {Bound, Patience}, {D, Rx, M}) ->
    check(none, [], convoy_chunk:tick(Patience, Rx), Bound, model_tick(Patience, M), D);
step({sweep, Busy}, {Bound, _Patience}, {D, Rx, M = #{watching := W}}) ->
    {Dropped, Rx1} = convoy_chunk:sweep(maps:keys(W), [?NODE || Busy], Rx),
    check(none, Dropped, Rx1, Bound, model_sweep(Busy, M), D);
step(E, {Bound, _Patience}, Acc) ->
    step(E, Bound, Acc);
step({start, Pid, Ref, Size, First, Payload, AckEvery}, Bound, {D, Rx, M}) ->
    St = #{ref => Ref, sender => Pid, to => dest, kind => binary, size => Size,
           mon => Ref, data => First, ack_every => AckEvery},
    {R, Dropped, Rx1} = convoy_chunk:start(?NODE, St, Bound, Rx),
    M1 = model_start(Pid, Ref, Size, First, Payload, AckEvery, Bound, M),
    check(R, Dropped, Rx1, Bound, M1#{watching := (maps:get(watching, M1))#{Pid => true}}, D);
step({unwatch, Pid}, _Bound, {D, Rx, M = #{watching := W}}) ->
    {D, Rx, M#{watching := maps:remove(Pid, W)}};
step({forged_start, Pid, Ref, Size}, Bound, {D, Rx, M}) ->
    St = #{ref => Ref, sender => Pid, to => dest, kind => binary, size => Size,
           mon => Ref, data => <<"x">>},
    {R, Dropped, Rx1} = convoy_chunk:start(?NODE, St, Bound, Rx),
    M1 = model_start(Pid, Ref, Size, <<"x">>, forged, 1, Bound, M),
    check(R, Dropped, Rx1, Bound, M1, D);
step({piece, _Pid, Ref, Seq, Data}, Bound, {D, Rx, M}) ->
    {R, Rx1} = convoy_chunk:piece(?NODE, Ref, Seq, Data, Rx),
    check(R, [], Rx1, Bound, model_piece(Ref, Seq, Data, M), D);
step({forged_piece, Ref, Seq, Data}, Bound, {D, Rx, M}) ->
    {R, Rx1} = convoy_chunk:piece(?NODE, Ref, Seq, Data, Rx),
    check(R, [], Rx1, Bound, model_piece(Ref, Seq, Data, M), D);
step({down, Pid}, Bound, {D, Rx, M}) ->
    %% the DOWN of the monitor kept with the sender's message in progress (the
    %% start's `mon' is its reference), if it has one
    Mon = case M of
              #{cur := #{Pid := #{ref := Ref}}} -> Ref;
              _ -> make_ref()
          end,
    {Dropped, Rx1} = convoy_chunk:down(Pid, Mon, Rx),
    check(none, Dropped, Rx1, Bound, model_drop(Pid, M), D);
step({forged_down, Pid}, Bound, {D, Rx, M}) ->
    %% a DOWN naming the sender with a reference that is no monitor of its
    %% message: nothing happens
    {Dropped, Rx1} = convoy_chunk:down(Pid, make_ref(), Rx),
    check(none, Dropped, Rx1, Bound, M#{dropped => 0}, D).

%% The model's expectations travel in `expect' (result kind) and `dropped'.
check(R, Dropped, Rx0, Bound, M = #{held := Held}, D) ->
    Expect = maps:get(expect, M, none),
    {Granted, Rx} = convoy_chunk:take_granted(Rx0),
    Granted =:= maps:get(granted, M) orelse throw({granted, Granted, expected, maps:get(granted, M)}),
    convoy_chunk:waiting(Rx) =:= (maps:get(queue, M) =/= [])
        orelse throw({waiting, convoy_chunk:waiting(Rx), expected, maps:get(queue, M)}),
    Got = case R of
              {ack, _} -> ack;
              stored -> stored;
              {complete, binary, dest, Parts, _Mon} -> {complete, iolist_to_binary(Parts)};
              refused -> refused;
              {error, bad_piece} -> bad_piece;
              none -> none
          end,
    Got =:= Expect orelse throw({result, Got, expected, Expect}),
    length(Dropped) =:= maps:get(dropped, M, 0)
        orelse throw({dropped, Dropped, expected, maps:get(dropped, M, 0)}),
    convoy_chunk:held(?NODE, Rx) =:= Held orelse throw({held, convoy_chunk:held(?NODE, Rx), Held}),
    (Bound =:= infinity orelse Held =< Bound) orelse throw({over_bound, Held, Bound}),
    D1 = case Got of
             {complete, Bin} -> [Bin | D];
             _ -> D
         end,
    {D1, Rx, (maps:without([expect, dropped], M))#{granted := []}}.

%% refs: every reference ever started: in_progress, done or dropped.
model_start(Pid, Ref, Size, First, Payload, AckEvery, Bound, M = #{refs := Refs}) ->
    case maps:get(Ref, Refs, none) of
        S when S =:= in_progress; S =:= done ->
            M#{expect => bad_piece};
        _ ->
            M1 = #{held := Held, refs := Refs1} = model_drop(Pid, M),
            case Bound =:= infinity orelse Held + Size =< Bound of
                false ->
                    M1#{expect => refused};
                true ->
                    Cur = #{ref => Ref, size => Size, got => byte_size(First), next => 1,
                            data => [First], payload => Payload, ack_every => AckEvery,
                            left => false},
                    M2 = M1#{held := Held + Size, cur := (maps:get(cur, M1))#{Pid => Cur},
                             refs := Refs1#{Ref => in_progress}, expect => ack},
                    case maybe_complete(Pid, Cur, M2) of
                        M3 = #{expect := ack, active := none} ->
                            M3#{active := {Ref, fresh}};
                        M3 = #{expect := ack, queue := Q} ->
                            M3#{queue := Q ++ [{Ref, 0}], expect := stored};
                        M3 ->
                            M3
                    end
            end
    end.

model_piece(Ref, Seq, Data, M = #{cur := Cur}) ->
    case [{P, C} || {P, C = #{ref := R}} <- maps:to_list(Cur), R =:= Ref] of
        [{Pid, C = #{next := Seq, got := Got, size := Size}}]
          when byte_size(Data) > 0, Got + byte_size(Data) =< Size ->
            C1 = C#{next := Seq + 1, got := Got + byte_size(Data),
                    data := maps:get(data, C) ++ [Data]},
            Expect = case Seq rem maps:get(ack_every, C) =:= maps:get(ack_every, C) - 1 of
                         true -> ack;
                         false -> stored
                     end,
            maybe_complete(Pid, C1, M#{cur := Cur#{Pid := C1}, expect => Expect});
        _ ->
            M#{expect => bad_piece}
    end.

maybe_complete(Pid, #{ref := Ref, got := Size, size := Size, data := Data},
               M = #{cur := Cur, held := Held, refs := Refs}) ->
    model_release(Ref, M#{cur := maps:remove(Pid, Cur), held := Held - Size,
                          refs := Refs#{Ref := done},
                          delivered := [iolist_to_binary(Data) | maps:get(delivered, M)],
                          expect => {complete, iolist_to_binary(Data)}});
maybe_complete(Pid, C, M = #{cur := Cur}) ->
    M#{cur := Cur#{Pid => C}}.

%% The sender's message in progress, if any, is discarded.
model_drop(Pid, M = #{cur := Cur, held := Held, refs := Refs}) ->
    case Cur of
        #{Pid := #{ref := Ref, size := Size}} ->
            model_release(Ref, M#{cur := maps:remove(Pid, Cur), held := Held - Size,
                                  refs := Refs#{Ref := dropped}, dropped => 1});
        _ ->
            M#{dropped => 0}
    end.

%% A message left (completed or discarded): if it had the turn, the oldest
%% waiting start gets it; if it waited, it waits no more.
model_release(Ref, M = #{active := {Ref, _}}) ->
    model_grant_next(M#{active := none});
model_release(Ref, M = #{queue := Q}) ->
    M#{queue := lists:keydelete(Ref, 1, Q)}.

%% A sweep: the messages marked at the previous one are discarded (unless the
%% node is busy), then those of senders not watching are marked. Turns given to
%% messages discarded in the same sweep are not given.
model_sweep(Busy, M0 = #{cur := Cur0}) ->
    Gone = [Pid || {Pid, #{left := true}} <- maps:to_list(Cur0), not Busy],
    M1 = lists:foldl(fun(Pid, Acc = #{dropped := N}) ->
                             (model_drop(Pid, Acc))#{dropped := N + 1}
                     end, M0#{dropped => 0}, Gone),
    #{cur := Cur1, watching := W, granted := G} = M1,
    Cur2 = maps:map(fun(Pid, C) -> C#{left := maps:get(left, C) orelse not is_map_key(Pid, W)} end,
                    Cur1),
    Live = [R || #{ref := R} <- maps:values(Cur2)],
    M1#{cur := Cur2, granted := [R || R <- G, lists:member(R, Live)]}.

model_grant_next(M = #{queue := []}) ->
    M;
model_grant_next(M = #{queue := [{Ref, _} | Rest], granted := G}) ->
    M#{queue := Rest, active := {Ref, fresh}, granted := G ++ [Ref]}.

%% Ticks only matter while starts wait.
model_tick(_Patience, M = #{queue := []}) ->
    M;
model_tick(Patience, M = #{active := Active, queue := Q, granted := G}) ->
    Active1 = case Active of
                  none -> none;
                  {Ref, Mark} ->
                      case next_of(Ref, M) of
                          Mark -> none;                   % no piece since the last tick
                          Next -> {Ref, Next}
                      end
              end,
    Q1 = [{R, W + 1} || {R, W} <- Q],
    Done = [R || {R, W} <- Q1, W >= Patience],
    M1 = M#{active := Active1, queue := [E || E = {_, W} <- Q1, W < Patience],
            granted := G ++ Done},
    case Active1 of
        none -> model_grant_next(M1);
        _ -> M1
    end.

next_of(Ref, #{cur := Cur}) ->
    [Next] = [N || #{ref := R, next := N} <- maps:values(Cur), R =:= Ref],
    Next.
