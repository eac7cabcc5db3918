%% PropEr properties of convoy_batch, the pure per-node queue core of an outbound
%% lane, run from EUnit (there is no rebar3 PropEr plugin here).
%%
%% A random command sequence (pushes of messages and control entries to several
%% nodes, one by one or as runs of messages, takes with a random limit, requeues of
%% a taken chunk or of its unsent tail, status changes, drops, and the passing of
%% time) is run against the core and a plain-list model. A chunk may be put back
%% any time before the next take from its node; in the strict variants only right
%% after its take, as the lane does. After every command:
%% <ul>
%% <li>per node, everything taken (and not put back) or dropped, followed by what
%%   is still queued, is exactly the pushed sequence: nothing lost, duplicated or
%%   reordered;</li>
%% <li>a chunk is a prefix of the queue with min(Max, queued messages) messages
%%   (control entries do not count), the whole queue when that fits;</li>
%% <li>`buffered/1,2' count the model's messages; `status/2' is the model's;</li>
%% <li>`due/4' lists exactly the ready, non-empty queues when `max_delay' is 0;</li>
%% <li>with `max_delay' > 0: a queue is due no later than its oldest message's
%%   deadline, `next_timeout/3' is `infinity' only when no ready queue holds a
%%   message, and a ready queue holding messages that is not due has a timeout
%%   between 1 and ceil(remaining / 1000) ms.</li>
%% </ul>
-module(prop_convoy_batch_tests).

%% For running a property by hand: proper:quickcheck(prop_convoy_batch_tests:prop_queue(delay)).
-export([prop_queue/1, prop_run_groups/0]).

-include_lib("proper/include/proper.hrl").
-include_lib("eunit/include/eunit.hrl").

%% Named after the property, so that a failure says which one.
-define(RUN(Prop, N), {??Prop, run(Prop, N)}).

-define(NODES, [n1@h, n2@h, n3@h]).
-define(HUGE, (1 bsl 40)).

%%--------------------------------------------------------------------
%% EUnit wrappers

queue_zero_delay_test_() ->
    ?RUN(prop_queue(zero_delay), 2000).

queue_zero_delay_strict_requeue_test_() ->
    ?RUN(prop_queue(zero_delay_strict), 1000).

queue_with_delay_test_() ->
    ?RUN(prop_queue(delay), 2000).

run_groups_test_() ->
    ?RUN(prop_run_groups(), 1000).

run(Prop, N) ->
    {timeout, 120,
     ?_assertEqual(ok, convoy_prop:check(Prop, [{numtests, N}, {to_file, user},
                                                {max_shrinks, 500}]))}.

%%--------------------------------------------------------------------
%% Generators

node_gen() -> oneof(?NODES).

kind() ->
    frequency([{8, msg}, {2, multi}, {4, mark}]).

cmd(Mode) ->
    Time = case Mode of
               delay -> [{3, {advance, choose(0, 2500)}}];
               _ -> []
           end,
    frequency([{12, {push, node_gen(), kind()}},
               {2, {push_many, node_gen(), choose(0, 5)}},
               {5, {take, node_gen(), choose(1, 6)}},
               {3, {requeue, node_gen(), choose(0, 6)}},
               %% A send that fails right after its take (noconnect), as in the lane.
               {3, {take_requeue, node_gen(), choose(1, 6), choose(0, 6)}},
               {3, {status, node_gen(), oneof([ready, busy, connecting])}},
               {1, {drop, node_gen()}}] ++ Time).

%% Long sequences: queues must grow past several chunks for requeues and partial
%% takes to matter.
cmds(Mode) ->
    ?SIZED(S, resize(4 * S, list(cmd(Mode)))).

settings(delay) -> {choose(1, 8), choose(1, 5000)};
settings(_) -> {choose(1, 8), exactly(0)}.

%%--------------------------------------------------------------------
%% The property

prop_queue(Mode) ->
    ?FORALL({{MaxBatch, MaxDelay}, Cmds}, {settings(Mode), cmds(Mode)},
            begin
                Strict = Mode =/= zero_delay,
                St0 = #{core => convoy_batch:new(), now => 1000, seq => 0, nodes => #{}},
                Result = (catch run_cmds(Cmds, St0, MaxBatch, MaxDelay, Strict)),
                ?WHENFAIL(io:format(user, "MaxBatch ~p MaxDelay ~p~nResult ~p~n",
                                    [MaxBatch, MaxDelay, Result]),
                          Result =:= ok)
            end).

run_cmds([], St, MB, MD, _Strict) ->
    check(St, MB, MD);
run_cmds([Cmd | Rest], St, MB, MD, Strict) ->
    St1 = exec(Cmd, forget_last(Cmd, St, Strict)),
    case check(St1, MB, MD) of
        ok -> run_cmds(Rest, St1, MB, MD, Strict);
        Err -> {Err, after_cmd, Cmd}
    end.

%% Strict: a chunk can only be put back by the command right after its take (as the
%% lane does: the requeue follows the take within one message).
forget_last({requeue, _, _}, St, _) -> St;
forget_last(_, St, false) -> St;
forget_last(_, St = #{nodes := Ns}, true) ->
    St#{nodes := maps:map(fun(_, M) -> M#{last := none} end, Ns)}.

model(Node, #{nodes := Ns}) ->
    maps:get(Node, Ns, #{pushed => [], out => [], q => [], status => ready,
                         last => none, times => #{}}).

put_model(Node, M, St = #{nodes := Ns}) -> St#{nodes := Ns#{Node => M}}.

entry(msg, Seq, _Node) -> {{dest, Seq rem 3}, {m, Seq}};
entry(multi, Seq, _Node) -> {[{dest, 1}, {dest, 2}], {m, Seq}};
entry(mark, Seq, Node) -> {'$convoy_mark', {ref, Seq}, Node}.

exec({push, Node, Kind}, St = #{core := C, now := Now, seq := Seq}) ->
    E = entry(Kind, Seq, Node),
    M = #{pushed := P, q := Q, times := T} = model(Node, St),
    put_model(Node, M#{pushed := P ++ [E], q := Q ++ [E], times := T#{E => Now}},
              St#{core := convoy_batch:push(Node, E, Now, C), seq := Seq + 1});
exec({push_many, Node, K}, St = #{core := C, now := Now, seq := Seq}) ->
    Es = [entry(msg, S, Node) || S <- lists:seq(Seq, Seq + K - 1)],
    M = #{pushed := P, q := Q, times := T} = model(Node, St),
    T1 = maps:merge(T, maps:from_list([{E, Now} || E <- Es])),
    put_model(Node, M#{pushed := P ++ Es, q := Q ++ Es, times := T1},
              St#{core := convoy_batch:push_many(Node, Es, K, Now, C), seq := Seq + K});
exec({take, Node, Max}, St = #{core := C, nodes := Ns}) when is_map_key(Node, Ns) ->
    case model(Node, St) of
        M = #{status := ready, q := Q, out := Out} ->
            {Chunk, C1} = convoy_batch:take(Node, Max, C),
            Len = length(Chunk),
            {Prefix, Rest} = lists:split(min(Len, length(Q)), Q),
            Msgs = msgs(Q),
            InChunk = msgs(Chunk),
            Chunk =:= Prefix orelse throw({chunk_not_prefix, Node, Chunk, Q}),
            InChunk =:= min(Max, Msgs) orelse throw({chunk_size, Node, Max, Chunk, Q}),
            Msgs > Max orelse Rest =:= [] orelse throw({chunk_not_whole_queue, Node, Chunk, Q}),
            put_model(Node, M#{q := Rest, out := Out ++ Chunk, last := Chunk},
                      St#{core := C1});
        _ ->
            St % only a ready queue may be taken from (the lane checks first)
    end;
exec({take, _Node, _Max}, St) ->
    St; % the lane never takes from a node it has not seen
exec({take_requeue, Node, Max, K}, St) ->
    exec({requeue, Node, K}, exec({take, Node, Max}, St));
exec({requeue, Node, K}, St = #{core := C}) ->
    case model(Node, St) of
        M = #{last := Chunk, q := Q, out := Out} when is_list(Chunk), Chunk =/= [] ->
            %% The first K entries left; the rest comes back (as after a partial
            %% plain send).
            {_Sent, Back} = lists:split(min(K, length(Chunk) - 1), Chunk),
            {Kept, Back} = lists:split(length(Out) - length(Back), Out),
            put_model(Node, M#{q := Back ++ Q, out := Kept, last := none},
                      St#{core := convoy_batch:requeue(Node, Back, C)});
        _ ->
            St
    end;
exec({status, Node, S}, St = #{core := C}) ->
    M = model(Node, St),
    put_model(Node, M#{status := S}, St#{core := convoy_batch:set_status(Node, S, C)});
exec({drop, Node}, St = #{core := C, nodes := Ns}) ->
    {Dropped, C1} = convoy_batch:drop(Node, C),
    case Ns of
        #{Node := M = #{q := Q, out := Out}} ->
            Dropped =:= Q orelse throw({drop, Node, Dropped, Q}),
            put_model(Node, M#{q := [], out := Out ++ Q, last := none}, St#{core := C1});
        _ ->
            Dropped =:= [] orelse throw({drop_unknown, Node, Dropped}),
            St#{core := C1}
    end;
exec({advance, Dt}, St = #{now := Now}) ->
    St#{now := Now + Dt}.

msgs(Entries) -> length([E || E <- Entries, is_msg(E)]).

is_msg({'$convoy_mark', _, _}) -> false;
is_msg(_) -> true.

%%--------------------------------------------------------------------
%% Invariants

check(St = #{core := C, nodes := Ns, now := Now}, MB, MD) ->
    try
        maps:foreach(fun(Node, M) -> check_node(Node, M, C) end, Ns),
        Total = lists:sum([msgs(Q) || #{q := Q} <- maps:values(Ns)]),
        Total =:= convoy_batch:buffered(C) orelse throw({buffered_total, Total}),
        lists:sort(maps:keys(Ns)) =:= lists:sort(convoy_batch:nodes(C))
            orelse throw({nodes, maps:keys(Ns), convoy_batch:nodes(C)}),
        check_due(St, Now, MB, MD),
        ok
    catch
        throw:Err -> Err
    end.

check_node(Node, #{pushed := P, out := Out, q := Q, status := S}, C) ->
    Out ++ Q =:= P orelse throw({lost_duplicated_or_reordered, Node, Out, Q, P}),
    msgs(Q) =:= convoy_batch:buffered(Node, C)
        orelse throw({buffered, Node, msgs(Q), convoy_batch:buffered(Node, C)}),
    S =:= convoy_batch:status(Node, C) orelse throw({status, Node}),
    %% Look at the whole queue without touching the real core (it is a value).
    {All, _} = convoy_batch:take(Node, ?HUGE, convoy_batch:set_status(Node, ready, C)),
    All =:= Q orelse throw({queue_content, Node, All, Q}).

check_due(#{core := C, nodes := Ns}, Now, MB, MD) ->
    Due = convoy_batch:due(Now, MB, MD, C),
    DueNodes = [N || {N, _} <- Due],
    length(lists:usort(DueNodes)) =:= length(DueNodes) orelse throw({due_twice, Due}),
    %% Never a queue that is not ready, or empty.
    [throw({due_not_ready_or_empty, N, R})
     || {N, R} <- Due,
        not (maps:get(status, maps:get(N, Ns)) =:= ready andalso
             maps:get(q, maps:get(N, Ns)) =/= [])],
    [check_reason(N, R, maps:get(N, Ns), MB, MD) || {N, R} <- Due],
    Ready = [{N, M} || {N, M = #{status := ready, q := Q}} <- maps:to_list(Ns), Q =/= []],
    case MD of
        0 ->
            %% Every ready, non-empty queue is due.
            lists:sort(DueNodes) =:= lists:sort([N || {N, _} <- Ready])
                orelse throw({not_all_ready_due, Due, [N || {N, _} <- Ready]}),
            convoy_batch:next_timeout(Now, 0, C) =:= infinity
                orelse throw(timeout_with_zero_delay);
        _ ->
            check_delay(Now, MB, MD, C, Ready, DueNodes)
    end,
    ok.

check_reason(N, R, #{q := Q}, MB, MD) ->
    Msgs = msgs(Q),
    Expected = if Msgs >= MB -> [max_batch];
                  MD =:= 0 -> [drained];
                  Msgs =:= 0 -> [drained]; % control entries only: at once
                  true -> [max_delay]
               end,
    lists:member(R, Expected) orelse throw({reason, N, R, Expected, Q}).

check_delay(Now, MB, MD, C, Ready, DueNodes) ->
    T = convoy_batch:next_timeout(Now, MD, C),
    WithMsgs = [{N, M} || {N, M = #{q := Q}} <- Ready, msgs(Q) > 0],
    %% The timeout is the nearest deadline: 0 only when a queue holding messages is
    %% already due.
    AnyDue = lists:any(fun({N, _}) -> lists:member(N, DueNodes) end, WithMsgs),
    (T =:= infinity) =:= (WithMsgs =:= [])
        orelse throw({timeout_infinity_mismatch, T, [N || {N, _} <- WithMsgs]}),
    lists:foreach(
      fun({N, #{q := Q, times := Times}}) ->
              Oldest = lists:min([maps:get(E, Times) || E <- Q, is_msg(E)]),
              Remaining = Oldest + MD - Now,
              Due = lists:member(N, DueNodes),
              Full = msgs(Q) >= MB,
              if
                  Remaining =< 0, not Due ->
                      throw({late, N, Remaining});
                  Full, not Due ->
                      throw({full_not_due, N});
                  not Due ->
                      Max = (Remaining + 999) div 1000,
                      is_integer(T) andalso (T >= 1 orelse AnyDue) andalso T =< Max
                          orelse throw({timeout_out_of_range, N, T, Max});
                  true ->
                      ok
              end
      end, WithMsgs).

%%--------------------------------------------------------------------
%% Plain EUnit cases for shapes the random commands reach rarely.

only_controls_due_at_once_with_delay_test() ->
    C = convoy_batch:push(n, {'$convoy_mark', 1, n}, 0, convoy_batch:new()),
    ?assertEqual([{n, drained}], convoy_batch:due(0, 10, 1000000, C)),
    ?assertEqual(infinity, convoy_batch:next_timeout(0, 1000000, C)).

take_stops_at_max_messages_test() ->
    B = {'$convoy_mark', 1, n},
    C0 = lists:foldl(fun(E, C) -> convoy_batch:push(n, E, 0, C) end, convoy_batch:new(),
                     [B, {d, 1}, B, {d, 2}, B, {d, 3}]),
    {Chunk, C1} = convoy_batch:take(n, 2, C0),
    ?assertEqual(2, convoy_batch:count_messages(Chunk)),
    ?assertEqual(lists:sublist([B, {d, 1}, B, {d, 2}, B, {d, 3}], length(Chunk)), Chunk),
    ?assertEqual(1, convoy_batch:buffered(n, C1)).

%%--------------------------------------------------------------------
%% run_groups/2: a run of large messages (and marks) cut into the groups that
%% each leave in one distribution message.

%% The groups, joined, are the run in order; no group is empty; a group of several
%% messages holds only messages of at most ShareBytes, adding up to at most
%% GroupBytes; and a group is cut only where the next message would not fit (so
%% the cutting is as coarse as the bounds allow).
prop_run_groups() ->
    ?FORALL({Run, GroupBytes, ShareBytes},
            {list(frequency([{6, {'$convoy_large', p, binary(), nat()}}, {1, mark}])),
             range(0, 400), range(0, 200)},
            begin
                Entries = [entry(E) || E <- Run],
                Groups = convoy_batch:run_groups(Entries, {GroupBytes, ShareBytes}),
                Sizes = fun(G) -> [convoy_size:bytes(M) || {'$convoy_large', _, M} <- G] end,
                Shared = fun(G) -> length(Sizes(G)) > 1 end,
                lists:append(Groups) =:= Entries
                    andalso lists:all(fun(G) -> G =/= [] end, Groups)
                    andalso lists:all(fun(G) -> not Shared(G)
                                                    orelse (lists:max(Sizes(G)) =< ShareBytes
                                                            andalso lists:sum(Sizes(G)) =< GroupBytes)
                                      end, Groups)
                    andalso coarse(Groups, Sizes, GroupBytes, ShareBytes)
            end).

entry({'$convoy_large', To, Bin, N}) -> {'$convoy_large', To, {Bin, N}};
entry(mark) -> {'$convoy_mark', 1, n}.

%% Each cut between two groups has a reason: the group before holds a message
%% over ShareBytes, or the next group's first message is over it, or it would not
%% have fitted in the group before.
coarse([A, B | Rest], Sizes, GroupBytes, ShareBytes) ->
    Before = Sizes(A),
    Next = case Sizes(B) of [] -> 0; [N | _] -> N end,
    (lists:any(fun(X) -> X > ShareBytes end, Before) orelse Next > ShareBytes
     orelse lists:sum(Before) + Next > GroupBytes)
        andalso coarse([B | Rest], Sizes, GroupBytes, ShareBytes);
coarse(_, _Sizes, _GroupBytes, _ShareBytes) ->
    true.
