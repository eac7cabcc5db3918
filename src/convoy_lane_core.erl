%% @private
%% The decisions of an outbound lane, pure: `handle(Event, Now, Core) -> {Core,
%% Actions}'. The lane process (`convoy_lane') reads its mailbox, gathers the facts
%% an event needs (the time, a node's room, what a send did), hands the event here
%% and carries out the actions in order. This module never sends, reads a clock or
%% touches shared state, so every rule below is tested without processes
%% (`test/prop_convoy_lane_core_tests.erl').
%%
%% What it holds:
%% <ul>
%% <li>sends read in this drain, not yet queued (queued in one go per node, so a
%%   message costs a cons until the drain ends or `max_batch' is reached);</li>
%% <li>one queue per node (`convoy_batch'), with flush marks among the entries;</li>
%% <li>per node, the bytes of each queued run, so a disposal gives back exactly
%%   the bytes senders took (`convoy_held');</li>
%% <li>senders blocked on a full node, woken one per message that leaves;</li>
%% <li>chunks handed out to ship and not yet reported, and nodes being
%%   connected. A chunk's outcome comes once it left: a lane waits out its node's
%%   busy connection itself (its lanes are the node's alone), so what waits
%%   behind it stays in the lane's mailbox, off its heap.</li>
%% <li>the hold/retire machine of a lane change or a stop (see `convoy_control').</li>
%% </ul>
%% Accounting: every message accepted here is, at any time, pending, queued, being
%% shipped, or disposed of (sent or dropped) exactly once; a disposal
%% is reported with its bytes (`{disposed, Node, K, Bytes}'), which the lane gives
%% back to the node's held counts and to its admission counters. A chunk to ship
%% carries its size too, messages and bytes (`{ship, Node, Wire, {Msgs, Bytes},
%% Reason}'), for the lane's choice of a compressed batch (`convoy_compress').
-module(convoy_lane_core).

-include("convoy_tags.hrl").
-export([new/3, handle/3, timeout/2, draining/1, holding/1, buffered/1, nodes/1, summary/1]).

-export_type([core/0, event/0, action/0, send/0, outcome/0]).

-record(core, {max_batch :: pos_integer(),
               max_delay :: non_neg_integer(),
               auto_connect :: boolean(),
               queues = convoy_batch:new() :: convoy_batch:core(),
               %% sends read and not yet queued, newest first
               pending = [] :: [send()],
               npending = 0 :: non_neg_integer(),
               %% per node, {Messages, Bytes} per queued run, oldest first
               segments = #{} :: #{node() => queue:queue({pos_integer(), non_neg_integer()})},
               waiters = #{} :: #{node() => queue:queue(reference())},
               next_mark = 0 :: non_neg_integer(),
               flushes = #{} :: #{non_neg_integer() => {pid() | reference(), term(), pos_integer()}},
               %% chunks handed out (a `ship' action) whose outcome is not in yet
               shipping = #{} :: #{node() => {non_neg_integer(), [mark()], convoy_batch:reason()}},
               connecting = #{} :: #{node() => true},
               %% nodes sent to since the last cycle: a node that was not, and
               %% holds nothing, is forgotten at the cycle's end
               pushed = #{} :: #{node() => true},
               held = none :: none | all | #{node() => true},
               deferred = [] :: [{pid() | reference(), term()}],
               retiring = false :: false | {draining, non_neg_integer()} | barriers
                                 | {barriers, #{node() => true}}}).

-opaque core() :: #core{}.
-type kind() :: ?TAG_SEND | ?TAG_LARGE | ?TAG_MULTICAST.
-type dest() :: pid() | atom() | reference().
%% A send a sender handed to the lane: kind, node, destination(s) or a `pg' group
%% (`convoy:publish/3'), message, bytes.
-type send() :: {kind(), node(), dest() | [dest()] | {?TAG_PUBLISH, atom(), term()},
                 term(), non_neg_integer()}.
-type mark() :: {?TAG_MARK, non_neg_integer(), node()}.
-type route() :: convoy | plain.
%% What a `ship' action did: everything left (`sent'), at once or after the lane
%% waited out a busy connection; the first messages left and the rest could not
%% (not connected: `unconnected'; a busy connection a stopping lane does not wait
%% for: `busy'), given back in order; no route to keep order with
%% (`unroutable').
-type outcome() :: {sent, Sends :: non_neg_integer(), route()}
                 | {unconnected | busy, Msgs :: non_neg_integer(), Sends :: non_neg_integer(),
                    Rest :: [term()], route()}
                 | unroutable.
-type event() :: {send, send()}
               | {sends, NewestFirst :: [send(), ...], Count :: pos_integer()}
               | {settings, MaxBatch :: pos_integer(), MaxDelay :: non_neg_integer()}
               | cycle
               | {shipped, node(), outcome()}
               | {wait, node(), Alias :: reference(), HasRoom :: boolean()}
               | {flush, all | node(), ReplyTo :: pid() | reference(), Tag :: term()}
               | {connected, node(), boolean()}
               | {hold, [node()]} | {release, node()} | {retire, Admitted :: non_neg_integer()}
               | {admissions_disposed, non_neg_integer()}
               | {barriers, [node()]} | {barrier_done, node()}
               | shutdown_ship | shutdown_drop.
-type action() :: {accepted, node(), pos_integer()}
                | {ship, node(), [term()], {Msgs :: pos_integer(), Bytes :: non_neg_integer()},
                   convoy_batch:reason()}
                | {sent, node(), Msgs :: non_neg_integer(), Sends :: non_neg_integer(),
                   convoy_batch:reason(), route()}
                | {dropped, node(), pos_integer(), Why :: atom()}
                | {disposed, node(), pos_integer(), Bytes :: non_neg_integer()}
                | {wake, reference()}
                | {reply, pid() | reference(), term()}
                | {connect, node()}
                | {forget, node()}
                | {dispose, 1} % a held lane opens: its admissions were one behind
                | start_barriers
                | retired
                | {stray, term()}.

%% @doc A new core; `Held' as for `convoy_lane:start_link/4'.
-spec new(none | all | [node()], {pos_integer(), non_neg_integer()}, boolean()) -> core().
new(Held, {MaxBatch, MaxDelay}, AutoConnect) ->
    #core{max_batch = MaxBatch, max_delay = MaxDelay, auto_connect = AutoConnect,
          held = case Held of
                     L when is_list(L) -> node_set(L);
                     _ -> Held
                 end}.

%% @doc Take one event at monotonic time `Now' (microseconds; any integer, the
%% clock can be negative). Actions are to be carried out in order; a `ship' action's
%% outcome comes back as a `shipped' event before anything else is handed in.
-spec handle(event(), integer(), core()) -> {core(), [action()]}.
handle({send, M}, Now, C = #core{pending = P, npending = K, max_batch = MB}) ->
    C1 = C#core{pending = [M | P], npending = K + 1},
    case K + 1 >= MB of
        false -> {C1, []};
        true -> done(full_queues(spill(Now, C1, [])))
    end;
handle({sends, Ms, N}, Now, C = #core{pending = P, npending = K, max_batch = MB}) ->
    %% Sends the lane read back to back, as if handed in one at a time.
    C1 = C#core{pending = Ms ++ P, npending = K + N},
    case K + N >= MB of
        false -> {C1, []};
        true -> done(full_queues(spill(Now, C1, [])))
    end;
handle({settings, MB, MD}, _Now, C) ->
    {C#core{max_batch = MB, max_delay = MD}, []};
handle({shipped, Node, Outcome}, Now, C) ->
    %% A chunk's outcome comes before anything else: nothing to spill.
    done(shipped(Node, Outcome, Now, C, []));
handle(Event, Now, C) ->
    %% Anything else is ordered after the sends read before it.
    done(event(Event, Now, spill(Now, C, []))).

done({C, A}) -> {C, lists:reverse(A)}.

event(cycle, Now, {C = #core{max_batch = MB, max_delay = MD}, A}) ->
    Due = [D || {Node, _} = D <- convoy_batch:due(Now, MB, MD, C#core.queues), not held(Node, C)],
    forget_idle(lists:foldl(fun({Node, Reason}, Acc) -> ship(Node, Reason, Acc) end, {C, A}, Due));
event({wait, _Node, Alias, true}, _Now, {C, A}) ->
    {C, [{wake, Alias} | A]};
event({wait, Node, Alias, false}, _Now, {C = #core{waiters = W}, A}) ->
    Q = maps:get(Node, W, queue:new()),
    {C#core{waiters = W#{Node => queue:in(Alias, Q)}}, A};
event({flush, Which, ReplyTo, Tag}, Now, CA) ->
    flush(Which, ReplyTo, Tag, Now, CA);
event({connected, Node, true}, _Now, {C, A}) ->
    {ready(Node, C), A};
event({connected, Node, false}, _Now, {C, A}) ->
    {Entries, Q} = convoy_batch:drop(Node, C#core.queues),
    prune(Node, dropped(Node, Entries, noconnect, {ready(Node, C#core{queues = Q}), A}));
event({hold, Nodes}, Now, {C = #core{held = all}, A}) ->
    released(Now, {C#core{held = node_set(Nodes)}, A});
event({release, Node}, Now, {C = #core{held = Held}, A}) when is_map(Held) ->
    released(Now, {C#core{held = maps:remove(Node, Held)}, A});
event({retire, K}, _Now, {C = #core{retiring = false}, A}) ->
    {C#core{retiring = {draining, K}}, A};
event({admissions_disposed, N}, _Now, {C = #core{retiring = {draining, K}}, A}) ->
    case N =:= K andalso idle_workers(C) of
        true -> {C#core{retiring = barriers}, [start_barriers | A]};
        false -> {C, A}
    end;
event({barriers, Nodes}, _Now, {C = #core{retiring = barriers}, A}) ->
    barriers_left({C#core{retiring = {barriers, node_set(Nodes)}}, A});
event({barrier_done, Node}, _Now, {C = #core{retiring = {barriers, Left}}, A}) ->
    barriers_left({C#core{retiring = {barriers, maps:remove(Node, Left)}}, A});
event(shutdown_ship, _Now, {C, A}) ->
    %% Held or not, everything that can leave now leaves.
    lists:foldl(fun(Node, Acc) -> ship(Node, drained, Acc) end, {C, A},
                convoy_batch:nodes(C#core.queues));
event(shutdown_drop, _Now, {C, A}) ->
    %% Connectors are gone with the lane: what is still queued cannot leave.
    C1 = C#core{connecting = #{}},
    lists:foldl(fun(Node, {C2, A2}) ->
                        {Entries, Q} = convoy_batch:drop(Node, C2#core.queues),
                        Q1 = convoy_batch:set_status(Node, ready, Q),
                        dropped(Node, Entries, shutdown, {C2#core{queues = Q1}, A2})
                end, {C1, A}, queued_nodes(C1));
event(Event, _Now, {C, A}) ->
    %% Out of place (a duplicate, or for a state the lane is not in).
    {C, [{stray, Event} | A]}.

queued_nodes(#core{queues = Q}) -> convoy_batch:nodes(Q).

node_set(Nodes) -> maps:from_list([{N, true} || N <- Nodes]).

ready(Node, C = #core{connecting = Cn, queues = Q}) ->
    C#core{connecting = maps:remove(Node, Cn), queues = convoy_batch:set_status(Node, ready, Q)}.

held(_Node, #core{held = none}) -> false;
held(_Node, #core{held = all}) -> true;
held(Node, #core{held = Held}) -> is_map_key(Node, Held).

idle_workers(#core{connecting = Cn, shipping = Sh}) ->
    map_size(Cn) =:= 0 andalso map_size(Sh) =:= 0.

barriers_left({C = #core{retiring = {barriers, Left}}, A}) when map_size(Left) =:= 0 ->
    {C, [retired | A]};
barriers_left(CA) ->
    CA.

%% Every held node released: the lane opens (its admissions started one behind, so
%% no sender saw it idle) and flushes deferred while it was held are served.
released(Now, {C = #core{held = Held, deferred = D}, A}) when map_size(Held) =:= 0 ->
    lists:foldr(fun({ReplyTo, Tag}, Acc) -> flush(all, ReplyTo, Tag, Now, Acc) end,
                {C#core{held = none, deferred = []}, [{dispose, 1} | A]}, D);
released(_Now, CA) ->
    CA.

%%--------------------------------------------------------------------
%% Queuing

%% Queue the pending sends, in order, one run of same-node messages at a time.
spill(_Now, C = #core{npending = 0}, A) ->
    {C, A};
spill(Now, C = #core{pending = P}, A) ->
    runs(runs(P, []), Now, C#core{pending = [], npending = 0}, A).

%% The runs of the pending sends (newest first), oldest run first, each run's
%% entries oldest first: read newest first, each run comes out in order as its
%% entries are consed, and each run goes before the newer ones already read.
runs([], Runs) ->
    Runs;
runs([{_, Node, _, _, _} | _] = Pending, Runs) ->
    {Entries, K, Large, Bytes, Rest} = run(Node, Pending, [], 0, 0, 0),
    runs(Rest, [{Node, Entries, K, Large, Bytes} | Runs]).

run(Node, [{?TAG_LARGE, Node, To, Msg, B} | Rest], Acc, K, L, Bytes) ->
    run(Node, Rest, [{?TAG_LARGE, To, Msg} | Acc], K + 1, L + 1, Bytes + B);
run(Node, [{?TAG_MULTICAST, Node, {?TAG_PUBLISH, Scope, Group}, Msg, B} | Rest], Acc, K, L,
    Bytes) ->
    %% queued as the wire's publish entry: a chunk of small messages ships as it is
    run(Node, Rest, [convoy_wire:publish(Scope, Group, Msg) | Acc], K + 1, L, Bytes + B);
run(Node, [{_, Node, To, Msg, B} | Rest], Acc, K, L, Bytes) ->
    run(Node, Rest, [{To, Msg} | Acc], K + 1, L, Bytes + B);
run(_Node, Rest, Acc, K, L, Bytes) -> {Acc, K, L, Bytes, Rest}.

runs([], _Now, C, A) ->
    {C, A};
runs([{Node, Entries, K, Large, Bytes} | Runs], Now, C, A) ->
    Segs = queue:in({K, Bytes}, maps:get(Node, C#core.segments, queue:new())),
    runs(Runs, Now,
         C#core{queues = convoy_batch:push_many(Node, Entries, K, Large, Now, C#core.queues),
                segments = (C#core.segments)#{Node => Segs},
                pushed = (C#core.pushed)#{Node => true}},
         [{accepted, Node, K} | A]).

%% max_batch messages read: full queues ship without waiting for the drain's end.
full_queues({C = #core{max_batch = MB, queues = Q}, A}) ->
    Full = [N || N <- convoy_batch:nodes(Q), convoy_batch:buffered(N, Q) >= MB,
                 not held(N, C)],
    lists:foldl(fun(N, Acc) -> ship(N, max_batch, Acc) end, {C, A}, Full).

%%--------------------------------------------------------------------
%% Shipping: one chunk at a time per node; its outcome (`shipped') takes the next.

ship(Node, _Reason, {C = #core{shipping = Sh}, A}) when is_map_key(Node, Sh) ->
    {C, A}; % a chunk of this node is out: its outcome ships the next
ship(Node, Reason, CA = {C, _}) ->
    case convoy_batch:status(Node, C#core.queues) of
        ready -> ship_ready(Node, Reason, CA);
        _BusyOrConnecting -> CA
    end.

ship_ready(Node, Reason, {C = #core{queues = Q, max_batch = MB}, A}) ->
    case convoy_batch:take(Node, MB, Q) of
        {[], Q1} ->
            {C#core{queues = Q1}, A}; % kept while sent to (`forget_idle/1')
        {Chunk, Q1} ->
            {Marks, Wire} = marks(Chunk),
            C1 = C#core{queues = Q1},
            case Wire of
                [] ->
                    ship(Node, Reason, answer_marks(Marks, {C1, A}));
                _ ->
                    Msgs = length(Wire),
                    Out = {Msgs, Marks, Reason},
                    {C1#core{shipping = (C1#core.shipping)#{Node => Out}},
                     [{ship, Node, Wire, {Msgs, chunk_bytes(Node, Msgs, C1)}, Reason} | A]}
            end
    end.

%% The bytes senders took for a chunk of Msgs messages taken from the head of the
%% node's queue: its runs' bytes, a part of a run counted in proportion (as
%% `release/3' gives it back).
chunk_bytes(Node, Msgs, #core{segments = Segs}) ->
    {Bytes, _Rest} = release(Msgs, maps:get(Node, Segs, queue:new()), 0),
    Bytes.

%% A mark is told from a message by its whole shape, never by its first element
%% alone: a message's entry is `{To, Msg}' (To a name, which may be any atom,
%% '$convoy_mark' too) or `{?TAG_LARGE, To, Msg}', so no message is a 3-tuple
%% opening with ?TAG_MARK.
is_mark({?TAG_MARK, _, _}) -> true;
is_mark(_) -> false.

%% A chunk's marks and its messages (wire entries). Marks are rare: one scan in C
%% tells whether the chunk may have any before it is split (a message to a name
%% '$convoy_mark' only costs that split).
marks(Chunk) ->
    case lists:keymember(?TAG_MARK, 1, Chunk) of
        false -> {[], Chunk};
        true -> lists:partition(fun is_mark/1, Chunk)
    end.

shipped(Node, Outcome, _Now, C = #core{shipping = Sh}, A) when is_map_key(Node, Sh) ->
    #{Node := {Msgs, Marks, Reason}} = Sh,
    shipped(Node, Outcome, Msgs, Marks, Reason, {C#core{shipping = maps:remove(Node, Sh)}, A});
shipped(Node, Outcome, _Now, C, A) ->
    {C, [{stray, {shipped, Node, Outcome}} | A]}.

shipped(Node, {sent, Sends, Route}, Msgs, Marks, Reason, CA) ->
    ship(Node, Reason, answer_marks(Marks, sent(Node, Msgs, Sends, Reason, Route, CA)));
shipped(Node, {busy, Sent, Sends, Rest, Route}, _Msgs, Marks, Reason, CA) ->
    %% The lane is stopping: the rest waits, in order, for `shutdown_drop'.
    {C, A} = sent(Node, Sent, Sends, Reason, Route, CA),
    Q = convoy_batch:requeue(Node, Rest ++ Marks, C#core.queues),
    {C#core{queues = convoy_batch:set_status(Node, busy, Q)}, A};
shipped(Node, {unconnected, Sent, Sends, Rest, Route}, _Msgs, Marks, Reason, CA) ->
    {C, A} = sent(Node, Sent, Sends, Reason, Route, CA),
    case C#core.auto_connect of
        true ->
            %% The marks go back after the rest: answered no earlier than before.
            Q = convoy_batch:requeue(Node, Rest ++ Marks, C#core.queues),
            {C#core{queues = convoy_batch:set_status(Node, connecting, Q),
                    connecting = (C#core.connecting)#{Node => true}},
             [{connect, Node} | A]};
        false ->
            ship(Node, Reason, dropped(Node, Rest ++ Marks, not_connected, {C, A}))
    end;
shipped(Node, unroutable, Msgs, Marks, Reason, CA) ->
    %% Neither a batch nor plain sends could keep order with what is in flight.
    ship(Node, Reason, answer_marks(Marks, dropped_count(Node, Msgs, stopped, CA))).

sent(_Node, 0, 0, _Reason, _Route, CA) ->
    CA;
sent(Node, Msgs, Sends, Reason, Route, {C, A}) ->
    disposed(Node, Msgs, {C, [{sent, Node, Msgs, Sends, Reason, Route} | A]}).

dropped(Node, Entries, Why, CA) ->
    {Marks, Wire} = lists:partition(fun is_mark/1, Entries),
    answer_marks(Marks, dropped_count(Node, convoy_batch:count_messages(Wire), Why, CA)).

dropped_count(_Node, 0, _Why, CA) ->
    CA;
dropped_count(Node, Msgs, Why, {C, A}) ->
    disposed(Node, Msgs, {C, [{dropped, Node, Msgs, Why} | A]}).

%% K messages of Node left (sent or dropped): give back their bytes, wake up to K
%% blocked senders, oldest first.
disposed(_Node, 0, CA) ->
    CA;
disposed(Node, K, {C = #core{segments = Segs, waiters = W}, A}) ->
    {Bytes, Q} = release(K, maps:get(Node, Segs, queue:new()), 0),
    {W1, A1} = case W of
                   #{Node := WQ} ->
                       {Woken, Rest} = queue:split(min(K, queue:len(WQ)), WQ),
                       {case queue:is_empty(Rest) of
                            true -> maps:remove(Node, W);
                            false -> W#{Node := Rest}
                        end,
                        lists:foldl(fun(Alias, Acc) -> [{wake, Alias} | Acc] end,
                                    [{disposed, Node, K, Bytes} | A], queue:to_list(Woken))};
                   _ ->
                       {W, [{disposed, Node, K, Bytes} | A]}
               end,
    {C#core{segments = Segs#{Node => Q}, waiters = W1}, A1}.

release(0, Q, Acc) ->
    {Acc, Q};
release(K, Q, Acc) ->
    case queue:out(Q) of
        {{value, {N, B}}, Q1} when N =< K ->
            release(K - N, Q1, Acc + B);
        {{value, {N, B}}, Q1} ->
            Part = B * K div N,
            {Acc + Part, queue:in_r({N - K, B - Part}, Q1)};
        {empty, Q} ->
            {Acc, Q}
    end.

%% At a cycle's end: the nodes nobody sent to since the last one, that hold
%% nothing, are forgotten; one streamed to keeps its queue (a queue forgotten
%% and made again at every batch cost the lane about a microsecond a batch).
forget_idle({C = #core{queues = Q, pushed = Pushed}, A}) ->
    Idle = [Node || Node <- convoy_batch:nodes(Q), not is_map_key(Node, Pushed),
                    convoy_batch:buffered(Node, Q) =:= 0],
    lists:foldl(fun prune/2, {C#core{pushed = #{}}, A}, Idle).

%% Nothing of Node's is left: forget its queue, and tell the lane to forget what it
%% keeps for it, so sends to many distinct nodes (dead names) leave nothing behind.
prune(Node, {C = #core{queues = Q, segments = Segs, waiters = W}, A}) ->
    Busy = is_map_key(Node, W) orelse is_map_key(Node, C#core.shipping)
        orelse not queue:is_empty(maps:get(Node, Segs, queue:new())),
    case not Busy andalso convoy_batch:forget(Node, Q) of
        {ok, Q1} -> {C#core{queues = Q1, segments = maps:remove(Node, Segs)},
                     [{forget, Node} | A]};
        _ -> {C, A}
    end.

%%--------------------------------------------------------------------
%% Flush: a mark in each queue concerned, answered once all are reached.

flush(all, ReplyTo, Tag, _Now, {C = #core{held = Held}, A}) when Held =/= none ->
    {C#core{deferred = [{ReplyTo, Tag} | C#core.deferred]}, A};
flush(Which, ReplyTo, Tag, Now, {C = #core{queues = Q, next_mark = Id}, A}) ->
    Nodes = case Which of
                all -> convoy_batch:nodes(Q);
                Node -> [Node]
            end,
    case Nodes of
        [] ->
            {C, [{reply, ReplyTo, Tag} | A]};
        _ ->
            Q1 = lists:foldl(fun(N, Acc) -> convoy_batch:push(N, {?TAG_MARK, Id, N}, Now, Acc)
                             end, Q, Nodes),
            C1 = C#core{queues = Q1, next_mark = Id + 1,
                        flushes = (C#core.flushes)#{Id => {ReplyTo, Tag, length(Nodes)}}},
            lists:foldl(fun(N, Acc = {Ci, _}) ->
                                case held(N, Ci) of
                                    true -> Acc;
                                    false -> ship(N, drained, Acc)
                                end
                        end, {C1, A}, Nodes)
    end.

answer_marks([], CA) ->
    CA;
answer_marks([{?TAG_MARK, Id, _Node} | Rest], {C = #core{flushes = F}, A}) ->
    case F of
        #{Id := {ReplyTo, Tag, 1}} ->
            answer_marks(Rest, {C#core{flushes = maps:remove(Id, F)}, [{reply, ReplyTo, Tag} | A]});
        #{Id := {ReplyTo, Tag, N}} ->
            answer_marks(Rest, {C#core{flushes = F#{Id := {ReplyTo, Tag, N - 1}}}, A})
    end.

%%--------------------------------------------------------------------
%% Queries

%% @doc Milliseconds until the lane should look again with no message (`infinity':
%% not before one comes).
-spec timeout(integer(), core()) -> timeout().
timeout(_Now, #core{retiring = {draining, _}}) ->
    1; % senders shipping their own messages have yet to report
timeout(Now, #core{queues = Q, max_delay = D}) ->
    convoy_batch:next_timeout(Now, D, Q).

%% @doc Whether the lane is retiring and waits for its admissions to be disposed of
%% (then it wants `{admissions_disposed, N}' after each cycle).
-spec draining(core()) -> boolean().
draining(#core{retiring = {draining, _}}) -> true;
draining(_) -> false.

%% @doc Messages this lane holds that its admission counters have not seen leave:
%% pending, queued, being shipped, plus the one a held lane starts
%% behind. A lane that is going compares this with its admissions to know whether
%% a sender is still on its way.
-spec holding(core()) -> non_neg_integer().
holding(C = #core{npending = P, queues = Q, held = Held}) ->
    P + convoy_batch:buffered(Q) + in_flight(C) + case Held of none -> 0; _ -> 1 end.

in_flight(#core{shipping = Sh}) ->
    maps:fold(fun(_, {M, _, _}, Acc) -> Acc + M end, 0, Sh).

%% @doc Messages queued (not counting pending sends or chunks out).
-spec buffered(core()) -> non_neg_integer().
buffered(#core{queues = Q}) -> convoy_batch:buffered(Q).

%% @doc Nodes this core keeps anything for.
-spec nodes(core()) -> [node()].
nodes(#core{queues = Q, segments = Segs, waiters = W}) ->
    lists:usort(convoy_batch:nodes(Q) ++ maps:keys(Segs) ++ maps:keys(W)).

%% @doc A map for `sys:get_state/1'.
-spec summary(core()) -> map().
summary(C = #core{}) ->
    #{buffered => buffered(C), pending => C#core.npending, held => C#core.held,
      retiring => C#core.retiring,
      connecting => maps:keys(C#core.connecting), flushes => map_size(C#core.flushes),
      waiters => maps:fold(fun(_, Q, Acc) -> Acc + queue:len(Q) end, 0, C#core.waiters)}.
