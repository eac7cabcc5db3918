%% @private
%% An outbound lane: collects what senders hand it, one queue per destination node
%% (`convoy_batch'), and ships each queue as one distribution message as soon as its
%% mailbox is drained (or after `max_delay' microseconds, or at `max_batch').
%%
%% The lane never waits on the network. It sends with `[nosuspend, noconnect]':
%% <ul>
%% <li>`nosuspend' (the node's distribution buffer is full): the chunk goes to a
%%   courier, a short-lived process that makes the blocking send; the node's queue
%%   waits until the courier is done, other nodes carry on;</li>
%% <li>`noconnect': the chunk goes back to its queue and a connector process asks
%%   `net_kernel' for a connection, as `!' would; if that fails, the node's queue is
%%   dropped and counted.</li>
%% </ul>
%% Peers that run a compatible convoy get batches in their inbox; others get plain
%% sends, one per message.
%%
%% Lanes are retired and replaced when `lanes' changes at run time and when convoy
%% stops; see `convoy_control' for the protocol (hold, retire, release). Messages
%% from convoy_control carry a secret reference given at start, so a stray copy of
%% one cannot hold, release or retire a lane.
%%
%% Helpers (couriers, connectors, barrier senders) are linked: they report their
%% result as their exit reason, and a lane that is killed takes its couriers with
%% it, so no chunk of a dead lane can arrive after what its replacement ships.
-module(convoy_lane).

-export([start_link/4, init/5, system_continue/3, system_terminate/4,
         system_get_state/1, system_code_change/4]).

-include("convoy_runtime.hrl").
-include_lib("kernel/include/logger.hrl").

-define(DRAIN_BUDGET, 10000).
%% At shutdown, how long to wait for a sender admitted just before the lane closed
%% (it is between its admission and its send: microseconds, unless descheduled).
-define(LATE_SENDER_MS, 200).
%% At shutdown, how long to wait for peers' inboxes to confirm delivery.
-define(SHUTDOWN_BARRIER_MS, 2000).

%% Couriers and connectors report their result as their exit reason, and
%% terminate/2 ends the process: all end by exit on purpose.
-dialyzer({nowarn_function, [courier/4, connect/3, terminate/2, retire_step/1]}).
-define(SEND_OPTS, [nosuspend, noconnect]).

-record(s, {index :: pos_integer(),
            parent :: pid(),
            %% convoy_control's pid and the secret its messages carry
            control :: {pid(), reference()},
            core = convoy_batch:new() :: convoy_batch:core(),
            %% settings as published (re-read each cycle)
            rt :: #runtime{},
            %% this lane's own admission counters
            slots :: convoy_slots:slots(),
            refs = #{} :: #{node() => {counters:counters_ref(), convoy_held:held()}},
            disposed = 0 :: non_neg_integer(),
            %% sends and multicasts read in this drain, newest first, not yet queued:
            %% queuing them in one go per node keeps the per-message cost to a cons
            pending = [] :: [{'$convoy_send' | '$convoy_large' | '$convoy_multicast', node(),
                               term(), term(), non_neg_integer()}],
            %% per node, {Messages, Bytes} per queued run, oldest first: what each
            %% disposal gives back to the node's held-bytes count
            segments = #{} :: #{node() => queue:queue({pos_integer(), non_neg_integer()})},
            npending = 0 :: non_neg_integer(),
            %% linked helpers, by pid
            workers = #{} :: #{pid() => {courier, node(), [term()], integer(), non_neg_integer()}
                                          | {connector, node()}
                                          | {barrier, node()}},
            %% a large message left this cycle: collect its copy at the cycle's end
            gc = false :: boolean(),
            %% the route each node had when this lane last shipped to it
            routes = #{} :: #{node() => plain | {convoy, pos_integer(), tuple()}},
            flushes = #{} :: #{reference() => {pid() | reference(), term(), pos_integer()}},
            %% senders blocked on a full node (overload block), oldest first
            waiters = #{} :: #{node() => queue:queue(reference())},
            held = none :: none | all | #{node() => true},
            deferred = [] :: [{pid() | reference(), term()}],
            retiring = false :: false | {draining, non_neg_integer()} | barriers,
            auto_connect :: boolean()}).

%% Held: `none', `all' (nodes are released by convoy_control) or a list of nodes.
-spec start_link(pos_integer(), none | all | [node()], #runtime{}, {pid(), reference()}) ->
          {ok, pid()}.
start_link(Index, Held, RT, Control) ->
    proc_lib:start_link(?MODULE, init, [self(), Index, Held, RT, Control]).

-spec init(pid(), pos_integer(), none | all | [node()], #runtime{}, {pid(), reference()}) ->
          no_return().
init(Parent, Index, Held, RT, Control) ->
    process_flag(message_queue_data, off_heap),
    process_flag(trap_exit, true),
    proc_lib:init_ack(Parent, {ok, self()}),
    AutoConnect = application:get_env(kernel, dist_auto_connect, always) =/= never,
    HeldNodes = case Held of
                    L when is_list(L) -> maps:from_list([{N, true} || N <- L]);
                    _ -> Held
                end,
    loop(#s{index = Index, parent = Parent, control = Control, held = HeldNodes,
            auto_connect = AutoConnect, rt = RT, slots = element(Index, RT#runtime.slots)}).

%% Settings are re-read when the lane wakes and at the end of each drain, so a
%% set_config/1 that has returned applies to everything the lane does next.
loop(S) ->
    receive
        Msg -> drain(handle(Msg, refresh(S)), ?DRAIN_BUDGET)
    after timeout(S) ->
        loop(cycle(S))
    end.

refresh(S = #s{rt = Own}) ->
    S#s{rt = persistent_term:get(?RUNTIME_KEY, Own)}.

drain(S, 0) ->
    loop(cycle(S));
drain(S, N) ->
    receive
        Msg -> drain(handle(Msg, S), N - 1)
    after 0 ->
        loop(cycle(S))
    end.

timeout(#s{retiring = {draining, _}}) ->
    1; % senders shipping their own messages have yet to report
timeout(#s{core = Core, rt = #runtime{max_delay = D}}) ->
    convoy_batch:next_timeout(now_us(), D, Core).

%% Always the real time, even when max_delay is 0: entries queued then may still be
%% waiting when max_delay is raised, and the monotonic clock can be negative, so no
%% constant can stand for "no time".
now_us() -> erlang:monotonic_time(microsecond).

%% End of a drain: ship what is due, publish the count of disposed admissions.
cycle(S0) ->
    S1 = spill(refresh(S0)),
    #runtime{max_batch = MB, max_delay = MD} = S1#s.rt,
    Due = convoy_batch:due(now_us(), MB, MD, S1#s.core),
    S2 = lists:foldl(fun({Node, Reason}, Acc) -> ship(Node, Reason, Acc) end, S1,
                     [D || {Node, _} = D <- Due, not held(Node, S1)]),
    retire_step(collect(publish(S2))).

collect(S = #s{gc = true}) ->
    true = erlang:garbage_collect(),
    S#s{gc = false};
collect(S) ->
    S.

publish(S = #s{disposed = 0}) ->
    S;
publish(S = #s{disposed = D, slots = Slots}) ->
    ok = convoy_slots:dispose(Slots, D),
    S#s{disposed = 0}.

held(_Node, #s{held = none}) -> false;
held(_Node, #s{held = all}) -> true;
held(Node, #s{held = Held}) -> is_map_key(Node, Held).

%%--------------------------------------------------------------------
%% Messages

%% Sends come from convoy_route in this node's processes; the guards keep a
%% malformed one (anything may reach a registered process) from crashing the lane.
handle({'$convoy_send', Node, To, _Msg, Bytes} = M, S)
  when is_atom(Node), is_integer(Bytes), Bytes >= 0,
       (is_pid(To) orelse is_atom(To) orelse is_reference(To)) ->
    add_pending(M, S);
handle({'$convoy_large', Node, To, _Msg, Bytes} = M, S)
  when is_atom(Node), is_integer(Bytes), Bytes >= 0,
       (is_pid(To) orelse is_atom(To) orelse is_reference(To)) ->
    add_pending(M, S);
handle({Kind, Node, Tos, _Msg, Bytes} = M, S)
  when Kind =:= '$convoy_multicast' orelse Kind =:= '$convoy_large',
       is_atom(Node), is_integer(Bytes), Bytes >= 0, is_list(Tos) ->
    case valid_tos(Tos) of
        true -> add_pending(M, S);
        false -> handle_other(bad_multicast, S)
    end;
handle(M, S) ->
    %% Anything else is ordered after the sends read before it.
    handle_other(M, spill(S)).

handle_other({'$convoy_wait', Node, Alias, Bytes}, S = #s{rt = RT})
  when is_atom(Node), is_reference(Alias), is_integer(Bytes), Bytes >= 0 ->
    {_, H} = refs(Node, S),
    case convoy_held:has_room(H, Bytes, RT#runtime.max_buffered, RT#runtime.max_buffered_bytes) of
        true ->
            Alias ! {Alias, room},
            S;
        false ->
            Q = maps:get(Node, S#s.waiters, queue:new()),
            S#s{waiters = (S#s.waiters)#{Node => queue:in(Alias, Q)}}
    end;
handle_other({'$convoy_flush', Which, ReplyTo, Tag}, S)
  when is_atom(Which), is_pid(ReplyTo) orelse is_reference(ReplyTo) ->
    flush_request(Which, ReplyTo, Tag, S);
handle_other({'EXIT', Parent, Reason}, S = #s{parent = Parent}) ->
    terminate(Reason, S);
handle_other({'EXIT', Pid, Reason}, S = #s{workers = W}) when is_map_key(Pid, W) ->
    worker_done(maps:get(Pid, W), Reason, S#s{workers = maps:remove(Pid, W)});
handle_other({'$convoy_hold', Secret, Nodes}, S = #s{control = {_, Secret}, held = all})
  when is_list(Nodes) ->
    released(S#s{held = maps:from_list([{N, true} || N <- Nodes, is_atom(N)])});
handle_other({'$convoy_release', Secret, Node}, S = #s{control = {_, Secret}, held = Held})
  when is_map(Held) ->
    released(S#s{held = maps:remove(Node, Held)});
handle_other({'$convoy_retire', Secret, K}, S = #s{control = {_, Secret}, retiring = false})
  when is_integer(K), K >= 0 ->
    S#s{retiring = {draining, K}};
handle_other({system, From, Req}, S) ->
    sys:handle_system_msg(Req, From, S#s.parent, ?MODULE, [], S);
handle_other(_Other, S) ->
    %% Stray, duplicated or malformed: counted, never fatal.
    convoy_metrics:rejected(unknown_message),
    S.

add_pending(M, S = #s{pending = P, npending = K, rt = #runtime{max_batch = MB}})
  when K + 1 >= MB ->
    S1 = spill(S#s{pending = [M | P], npending = K + 1}),
    lists:foldl(fun(Node, Acc) -> ship_now(Node, max_batch, Acc) end, S1,
                [N || N <- convoy_batch:nodes(S1#s.core),
                      convoy_batch:buffered(N, S1#s.core) >= MB]);
add_pending(M, S = #s{pending = P, npending = K}) ->
    S#s{pending = [M | P], npending = K + 1}.

valid_tos([]) -> true;
valid_tos([To | Rest]) when is_pid(To); is_atom(To); is_reference(To) -> valid_tos(Rest);
valid_tos(_) -> false.

%% Queue the pending sends, in order, one run of same-node messages at a time.
spill(S = #s{npending = 0}) ->
    S;
spill(S = #s{pending = P}) ->
    runs(lists:reverse(P), now_us(), S#s{pending = [], npending = 0}).

runs([], _Now, S) ->
    S;
runs([{_, Node, _, _, _} | _] = Pending, Now, S) ->
    {Entries, K, Bytes, Rest} = run(Node, Pending, [], 0, 0),
    {C, _} = Refs = refs(Node, S),
    convoy_metrics:add(C, accepted, K),
    Segs = queue:in({K, Bytes}, maps:get(Node, S#s.segments, queue:new())),
    runs(Rest, Now, S#s{core = convoy_batch:push_many(Node, Entries, K, Now, S#s.core),
                        refs = (S#s.refs)#{Node => Refs},
                        segments = (S#s.segments)#{Node => Segs}}).

run(Node, [{'$convoy_large', Node, To, Msg, B} | Rest], Acc, K, Bytes) ->
    run(Node, Rest, [{'$convoy_large', To, Msg} | Acc], K + 1, Bytes + B);
run(Node, [{_, Node, To, Msg, B} | Rest], Acc, K, Bytes) ->
    run(Node, Rest, [{To, Msg} | Acc], K + 1, Bytes + B);
run(_Node, Rest, Acc, K, Bytes) -> {lists:reverse(Acc), K, Bytes, Rest}.

%% Someone waits on this queue (flush) or it is full: ship it without
%% waiting for the end of the drain or for max_delay.
ship_now(Node, S) ->
    ship_now(Node, requested, S).

ship_now(Node, Reason, S) ->
    case held(Node, S) of
        true -> S;
        false -> ship(Node, Reason, S)
    end.

counters(Node, S) ->
    element(1, refs(Node, S)).

refs(Node, #s{refs = Refs}) ->
    case Refs of
        #{Node := R} -> R;
        _ -> node_refs(Node)
    end.

%% While convoy's tree is torn down (no convoy_peers) counts go to counters of the
%% lane's own, which its shutdown summary reports.
node_refs(Node) ->
    case convoy_metrics:node_refs(Node) of
        undefined -> convoy_metrics:new_refs();
        Refs -> Refs
    end.

%% K messages for Node left (sent or dropped): the admissions are disposed of and
%% the node's held counts go down by them and their bytes.
disposed(_Node, 0, S) ->
    S;
disposed(Node, K, S = #s{segments = Segs}) ->
    {Bytes, Q} = release(K, maps:get(Node, Segs, queue:new()), 0),
    {_, H} = refs(Node, S),
    ok = convoy_held:release(H, K, Bytes),
    wake(Node, K, S#s{disposed = S#s.disposed + K, segments = Segs#{Node => Q}}).

%% K messages left: wake up to K blocked senders, oldest first.
wake(Node, K, S = #s{waiters = W}) ->
    case W of
        #{Node := Q} ->
            {Woken, Rest} = queue:split(min(K, queue:len(Q)), Q),
            _ = [A ! {A, room} || A <- queue:to_list(Woken)],
            S#s{waiters = case queue:is_empty(Rest) of
                              true -> maps:remove(Node, W);
                              false -> W#{Node := Rest}
                          end};
        _ ->
            S
    end.


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

%%--------------------------------------------------------------------
%% Shipping

ship(Node, Reason, S = #s{core = Core, rt = #runtime{max_batch = MB}}) ->
    case convoy_batch:status(Node, Core) =:= ready
        andalso convoy_batch:take(Node, MB, Core) of
        false ->
            S;
        {[], _} ->
            prune(Node, S);
        {Chunk, Core1} ->
            {Route, S1} = route(Node, S#s{core = Core1}),
            ship(Node, Reason, ship_chunk(Node, Route, Chunk, Reason, S1))
    end.

%% Nothing of Node's is left in this lane: forget its queue, its counters (fetched
%% again when needed, so a row convoy_peers has forgotten is never written to) and
%% a plain route. Sends to many distinct nodes (dead names) leave nothing behind. A
%% convoy route stays for shutdown barriers until a lookup finds the node plain.
prune(Node, S = #s{core = Core, segments = Segs, waiters = W, routes = Routes}) ->
    Forgotten = case is_map_key(Node, W)
                    orelse not queue:is_empty(maps:get(Node, Segs, queue:new())) of
                    true -> busy;
                    false -> convoy_batch:forget(Node, Core)
                end,
    case Forgotten of
        busy ->
            S;
        {ok, Core1} ->
            S#s{core = Core1, refs = maps:remove(Node, S#s.refs),
                segments = maps:remove(Node, Segs),
                routes = case Routes of
                             #{Node := plain} -> maps:remove(Node, Routes);
                             _ -> Routes
                         end}
    end.

%% The route last seen is kept: while convoy's tree is torn down (node table gone)
%% the lane still ships what it holds, and confirms it (shutdown barriers).
route(Node, S = #s{routes = Routes}) ->
    case route(Node) of
        unknown -> {maps:get(Node, Routes, unknown), S};
        Route -> {Route, S#s{routes = Routes#{Node => Route}}}
    end.

route(Node) ->
    case convoy_peers:lookup(Node) of
        {Route, _C, _H} -> Route;
        none -> table_route()
    end.

%% No row: plain, unless the table is gone (convoy's tree is torn down).
table_route() ->
    case ets:whereis(convoy_nodes) of
        undefined -> unknown;
        _ -> plain
    end.

%% A large message ships alone; its copy in the lane's heap is collected at the end
%% of the cycle rather than whenever the heap next grows.
ship_chunk(Node, Route, [{'$convoy_large', _, _}] = Chunk, Reason, S) ->
    ship_route(Node, Route, Chunk, Reason, S#s{gc = true});
ship_chunk(Node, Route, Chunk, Reason, S) ->
    ship_route(Node, Route, Chunk, Reason, S).

ship_route(Node, unknown, Chunk, _Reason, S) ->
    %% Neither a batch nor plain sends could keep order with what is in flight.
    dropped(Node, Chunk, stopped, S);
ship_route(Node, {convoy, _Vsn, Inboxes}, Chunk, Reason, S = #s{index = I}) ->
    {Marks, Wire} = lists:partition(fun is_mark/1, Chunk),
    case Wire of
        [] ->
            answer_marks(Marks, S);
        _ ->
            Target = {convoy_wire:lane_inbox(I, Inboxes), Node},
            Batch = convoy_wire:batch(node(), [wire_entry(E) || E <- Wire]),
            Msgs = convoy_batch:count_messages(Wire),
            case erlang:send(Target, Batch, ?SEND_OPTS) of
                ok ->
                    S1 = sent(Node, Msgs, 1, Reason, convoy, S),
                    answer_marks(Marks, S1);
                nosuspend ->
                    courier(Node, [{Target, Batch, Msgs}], Marks, S);
                noconnect ->
                    connect(Node, Chunk, S)
            end
    end;
ship_route(Node, plain, Chunk, Reason, S) ->
    plain(Node, Chunk, Reason, 0, 0, S).

is_mark(E) -> element(1, E) =:= '$convoy_mark'.

wire_entry({'$convoy_large', To, Msg}) -> {To, Msg};
wire_entry(E) -> E.

%% Plain sends, entry by entry, for peers without a compatible convoy.
plain(Node, [], Reason, Msgs, Sends, S) ->
    sent(Node, Msgs, Sends, Reason, plain, S);
plain(Node, [E | Rest], Reason, Msgs, Sends, S) ->
    case wire_entry(E) of
        {'$convoy_mark', _, _} ->
            plain(Node, Rest, Reason, Msgs, Sends, answer_marks([E], S));
        {Tos, Msg} when is_list(Tos) ->
            case plain_multi(Node, Tos, Msg, 0) of
                {ok, K} ->
                    plain(Node, Rest, Reason, Msgs + 1, Sends + K, S);
                {nosuspend, K, Left} ->
                    S1 = sent(Node, Msgs, Sends + K, Reason, plain, S),
                    plain_courier(Node, [{Left, Msg} | Rest], S1);
                {noconnect, K, Left} ->
                    S1 = sent(Node, Msgs, Sends + K, Reason, plain, S),
                    connect(Node, [{Left, Msg} | Rest], S1)
            end;
        {To, Msg} ->
            case erlang:send(full_dest(To, Node), Msg, ?SEND_OPTS) of
                ok ->
                    plain(Node, Rest, Reason, Msgs + 1, Sends + 1, S);
                nosuspend ->
                    plain_courier(Node, [E | Rest], sent(Node, Msgs, Sends, Reason, plain, S));
                noconnect ->
                    connect(Node, [E | Rest], sent(Node, Msgs, Sends, Reason, plain, S))
            end
    end.

plain_multi(_Node, [], _Msg, K) ->
    {ok, K};
plain_multi(Node, [To | Rest] = Tos, Msg, K) ->
    case erlang:send(full_dest(To, Node), Msg, ?SEND_OPTS) of
        ok -> plain_multi(Node, Rest, Msg, K + 1);
        Other -> {Other, K, Tos}
    end.

%% The rest of a plain chunk, as blocking sends for a courier.
plain_courier(Node, Entries, S) ->
    {Marks, Wire} = lists:partition(fun is_mark/1, Entries),
    Ops = lists:append([plain_ops(Node, E) || E <- Wire]),
    courier(Node, Ops, Marks, S).

plain_ops(Node, {'$convoy_large', To, Msg}) ->
    plain_ops(Node, {To, Msg});
plain_ops(Node, {Tos, Msg}) when is_list(Tos) ->
    {Init, [Last]} = lists:split(length(Tos) - 1, Tos),
    [{full_dest(T, Node), Msg, 0} || T <- Init] ++ [{full_dest(Last, Node), Msg, 1}];
plain_ops(Node, {To, Msg}) ->
    [{full_dest(To, Node), Msg, 1}].

full_dest(Name, Node) when is_atom(Name) -> {Name, Node};
full_dest(PidOrRef, _Node) -> PidOrRef.

sent(_Node, 0, 0, _Reason, _Route, S) ->
    S;
sent(Node, Msgs, Sends, Reason, Route, S = #s{index = I, rt = RT}) ->
    C = counters(Node, S),
    convoy_metrics:add(C, messages, Msgs),
    convoy_metrics:add(C, batches, Sends),
    event(RT, [convoy, batch, sent], #{count => Msgs, sends => Sends},
          #{node => Node, lane => I, reason => Reason, route => Route}),
    disposed(Node, Msgs, S).

dropped(_Node, [], _Why, S) ->
    S;
dropped(Node, Entries, Why, S = #s{index = I, rt = RT}) ->
    {Marks, Wire} = lists:partition(fun is_mark/1, Entries),
    S1 = case convoy_batch:count_messages(Wire) of
             0 ->
                 S;
             Msgs ->
                 convoy_metrics:add(counters(Node, S), dropped, Msgs),
                 event(RT, [convoy, batch, dropped], #{count => Msgs},
                       #{node => Node, lane => I, reason => Why}),
                 disposed(Node, Msgs, S)
         end,
    answer_marks(Marks, S1).

event(#runtime{telemetry = true}, Name, Measurements, Meta) ->
    convoy_metrics:emit(Name, Measurements, Meta);
event(_RT, _Name, _Measurements, _Meta) ->
    ok.

%%--------------------------------------------------------------------
%% Couriers and connectors

courier(Node, Ops, Marks, S = #s{index = I, rt = RT}) ->
    Pid = spawn_link(fun() -> exit({courier, run_ops(Ops, 0, 0, 0)}) end),
    Msgs = lists:sum([W || {_, _, W} <- Ops]),
    event(RT, [convoy, node, busy], #{count => Msgs}, #{node => Node, lane => I}),
    S#s{core = convoy_batch:set_status(Node, busy, S#s.core),
        workers = (S#s.workers)#{Pid => {courier, Node, Marks, erlang:monotonic_time(), Msgs}}}.

%% Blocking sends (they wait out a busy distribution buffer, never connect).
%% Returns {Messages sent, sends made, messages not sent}.
run_ops([], Msgs, Sends, Lost) ->
    {Msgs, Sends, Lost};
run_ops([{Dest, Term, W} | Rest], Msgs, Sends, Lost) ->
    case erlang:send(Dest, Term, [noconnect]) of
        ok -> run_ops(Rest, Msgs + W, Sends + 1, Lost);
        noconnect -> run_ops(Rest, Msgs, Sends, Lost + W)
    end.

connect(Node, Entries, S = #s{auto_connect = false}) ->
    dropped(Node, Entries, not_connected, S);
connect(Node, Entries, S) ->
    Pid = spawn_link(fun() -> exit({connected, net_kernel:connect_node(Node)}) end),
    S#s{core = convoy_batch:set_status(Node, connecting,
                                       convoy_batch:requeue(Node, Entries, S#s.core)),
        workers = (S#s.workers)#{Pid => {connector, Node}}}.

worker_done({courier, Node, Marks, Started, _Msgs}, Reason, S = #s{index = I, rt = RT}) ->
    {Msgs, Sends, Lost} = case Reason of
                              {courier, Result} -> Result;
                              _ -> {0, 0, 0}
                          end,
    S1 = sent(Node, Msgs, Sends, resumed, courier, S),
    S2 = case Lost of
             0 -> S1;
             _ ->
                 convoy_metrics:add(counters(Node, S1), dropped, Lost),
                 event(RT, [convoy, batch, dropped], #{count => Lost},
                       #{node => Node, lane => I, reason => noconnect}),
                 disposed(Node, Lost, S1)
         end,
    event(RT, [convoy, node, resumed],
          #{duration => erlang:monotonic_time() - Started}, #{node => Node, lane => I}),
    S3 = answer_marks(Marks, S2),
    prune(Node, S3#s{core = convoy_batch:set_status(Node, ready, S3#s.core)});
worker_done({connector, Node}, {connected, true}, S) ->
    S#s{core = convoy_batch:set_status(Node, ready, S#s.core)};
worker_done({connector, Node}, _Failed, S) ->
    {Entries, Core} = convoy_batch:drop(Node, convoy_batch:set_status(Node, ready, S#s.core)),
    prune(Node, dropped(Node, Entries, noconnect, S#s{core = Core}));
worker_done({barrier, Node}, _Reason, S = #s{control = {Control, Secret}}) ->
    Control ! {'$convoy_node_done', Secret, self(), Node},
    S.

%%--------------------------------------------------------------------
%% Flush requests: a mark in each queue concerned; answered when all are reached.

flush_request(all, ReplyTo, Tag, S = #s{held = Held}) when Held =/= none ->
    S#s{deferred = [{ReplyTo, Tag} | S#s.deferred]};
flush_request(Which, ReplyTo, Tag, S = #s{core = Core}) ->
    Nodes = case Which of
                all -> convoy_batch:nodes(Core);
                Node -> [Node]
            end,
    Ref = make_ref(),
    Core1 = lists:foldl(fun(N, C) -> convoy_batch:push(N, {'$convoy_mark', Ref, N}, 0, C) end,
                        Core, Nodes),
    case Nodes of
        [] ->
            ReplyTo ! {Tag, ok},
            S;
        _ ->
            S1 = S#s{core = Core1,
                     flushes = (S#s.flushes)#{Ref => {ReplyTo, Tag, length(Nodes)}}},
            lists:foldl(fun ship_now/2, S1, Nodes)
    end.

answer_marks([], S) ->
    S;
answer_marks([{'$convoy_mark', Ref, _Node} | Rest], S = #s{flushes = F}) ->
    F1 = case F of
             #{Ref := {ReplyTo, Tag, 1}} ->
                 ReplyTo ! {Tag, ok},
                 maps:remove(Ref, F);
             #{Ref := {ReplyTo, Tag, N}} ->
                 F#{Ref := {ReplyTo, Tag, N - 1}}
         end,
    answer_marks(Rest, S#s{flushes = F1}).

%%--------------------------------------------------------------------
%% Replacing lanes (see convoy_control)

%% Every held node released: open the fast path (the admission slot was started one
%% behind, so senders saw this lane as busy) and serve deferred flushes.
released(S = #s{held = Held, slots = Slots}) when map_size(Held) =:= 0 ->
    ok = convoy_slots:dispose(Slots, 1),
    lists:foldr(fun({ReplyTo, Tag}, Acc) -> flush_request(all, ReplyTo, Tag, Acc) end,
                S#s{held = none, deferred = []}, S#s.deferred);
released(S) ->
    S.

%% A retiring lane first waits until every admission it granted is disposed of,
%% then makes sure each convoy peer's inbox has delivered what it sent (barrier),
%% reporting each node to convoy_control as it is done.
retire_step(S = #s{retiring = {draining, K}, slots = Slots, workers = W,
                   control = {Control, Secret}}) ->
    case convoy_slots:disposed(Slots) =:= K andalso map_size(W) =:= 0 of
        true ->
            Nodes = convoy_peers:convoy_nodes(),
            Control ! {'$convoy_retiring', Secret, self(), Nodes},
            S1 = lists:foldl(fun retire_barrier/2, S#s{retiring = barriers}, Nodes),
            retire_step(S1);
        false ->
            S
    end;
retire_step(#s{retiring = barriers, workers = W, control = {Control, Secret}})
  when map_size(W) =:= 0 ->
    Control ! {'$convoy_retired', Secret, self()},
    exit(normal);
retire_step(S) ->
    S.

%% A helper process sends the barrier (blocking: it may wait out a busy buffer) and
%% ends when the inbox answers or cannot (node or inbox gone, or no longer a convoy
%% peer).
retire_barrier(Node, S = #s{index = I}) ->
    Pid = spawn_link(fun() -> barrier(I, Node, route(Node)) end),
    S#s{workers = (S#s.workers)#{Pid => {barrier, Node}}}.

%% Returns once lane I's inbox on Node has delivered everything before it.
barrier(I, Node, {convoy, _, Inboxes}) ->
    Inbox = {convoy_wire:lane_inbox(I, Inboxes), Node},
    Mon = erlang:monitor(process, Inbox),
    Tag = make_ref(),
    _ = erlang:send(Inbox, convoy_wire:batch(node(), [convoy_wire:barrier(self(), Tag)]),
                    [noconnect]),
    receive
        {Tag, convoy_barrier} -> ok;
        {'DOWN', Mon, process, _, _} -> ok
    end;
barrier(_I, _Node, _NotConvoy) ->
    ok.

%% At shutdown: what this lane shipped is delivered before it goes (bounded), so
%% that its senders' plain sends that follow cannot overtake it.
shutdown_barriers(#s{index = I, routes = Routes}) ->
    Deadline = erlang:monotonic_time(millisecond) + ?SHUTDOWN_BARRIER_MS,
    Mons = [element(2, spawn_monitor(fun() -> barrier(I, Node, Route) end))
            || {Node, {convoy, _, _} = Route} <- maps:to_list(Routes)],
    lists:foreach(fun(Mon) ->
                          receive
                              {'DOWN', Mon, process, _, _} -> ok
                          after max(0, Deadline - erlang:monotonic_time(millisecond)) ->
                              erlang:demonitor(Mon, [flush])
                          end
                  end, Mons).

%%--------------------------------------------------------------------
%% Shutdown (convoy stops, or its tree is torn down): everything handed over
%% before is read from the mailbox, what can leave without waiting leaves, and the
%% rest, with what couriers still carry, is counted as dropped and logged.

terminate(Reason, S) ->
    _ = convoy_slots:close(S#s.slots),
    S0 = spill(read_mailbox(S)),
    Before = dropped_counts(S0),
    S1 = lists:foldl(fun(Node, Acc) -> ship(Node, drained, Acc) end, S0,
                     convoy_batch:nodes(S0#s.core)),
    S2 = maps:fold(fun stop_worker/3, S1#s{workers = #{}}, S1#s.workers),
    S3 = lists:foldl(fun(Node, Acc) ->
                             {Entries, Core} = convoy_batch:drop(Node, Acc#s.core),
                             dropped(Node, Entries, shutdown, Acc#s{core = Core})
                     end, S2, convoy_batch:nodes(S2#s.core)),
    S4 = publish(S3),
    ok = shutdown_barriers(S4),
    After = dropped_counts(S4),
    Lost = maps:filter(fun(_, N) -> N > 0 end,
                       maps:map(fun(Node, N) -> N - maps:get(Node, Before, 0) end, After)),
    _ = map_size(Lost) =:= 0 orelse
        ?LOG_WARNING(#{what => convoy_lane_stopped, lane => S#s.index, reason => Reason,
                       dropped => Lost}),
    exit(Reason).

%% Everything senders were admitted for: the lane is closed, and a sender admitted
%% just before may still be on its way (bounded wait). System messages are left:
%% the lane is going.
read_mailbox(S) ->
    read_mailbox(S, erlang:monotonic_time(millisecond) + ?LATE_SENDER_MS).

read_mailbox(S = #s{parent = Parent, slots = Slots}, Deadline) ->
    receive
        {system, _, _} -> read_mailbox(S, Deadline);
        {'EXIT', Parent, _} -> read_mailbox(S, Deadline);
        M -> read_mailbox(handle(M, S), Deadline)
    after 0 ->
        Outstanding = convoy_slots:admitted(Slots) - convoy_slots:disposed(Slots)
            - S#s.disposed - S#s.npending - convoy_batch:buffered(S#s.core)
            - in_couriers(S) - still_held(S),
        case Outstanding > 0 andalso erlang:monotonic_time(millisecond) < Deadline of
            true -> receive after 1 -> read_mailbox(S, Deadline) end;
            false -> S
        end
    end.

%% A held lane's counters start one behind until it is released.
still_held(#s{held = none}) -> 0;
still_held(_) -> 1.

in_couriers(#s{workers = W}) ->
    maps:fold(fun(_, {courier, _, _, _, Msgs}, Acc) -> Acc + Msgs;
                 (_, _, Acc) -> Acc
              end, 0, W).

dropped_counts(S = #s{refs = Refs}) ->
    maps:map(fun(Node, _) ->
                     maps:get(dropped, convoy_metrics:node_info(counters(Node, S)))
             end, Refs).

%% A courier may still be waiting on a busy connection: it goes with the lane and
%% its messages count as dropped (some may have left).
stop_worker(Pid, {courier, Node, Marks, _Started, Msgs}, S = #s{index = I, rt = RT}) ->
    true = unlink(Pid),
    true = exit(Pid, kill),
    convoy_metrics:add(counters(Node, S), dropped, Msgs),
    event(RT, [convoy, batch, dropped], #{count => Msgs},
          #{node => Node, lane => I, reason => shutdown}),
    answer_marks(Marks, disposed(Node, Msgs, S));
stop_worker(Pid, _Other, S) ->
    true = unlink(Pid),
    true = exit(Pid, kill),
    S.

%%--------------------------------------------------------------------
%% sys

-spec system_continue(pid(), [sys:debug_option()], #s{}) -> no_return().
system_continue(_Parent, _Debug, S) -> drain(S, ?DRAIN_BUDGET). % ship once drained

-spec system_terminate(term(), pid(), [sys:debug_option()], #s{}) -> no_return().
system_terminate(Reason, _Parent, _Debug, S) -> terminate(Reason, S).

-spec system_get_state(#s{}) -> {ok, map()}.
system_get_state(S) ->
    {ok, #{index => S#s.index, buffered => convoy_batch:buffered(S#s.core),
           held => S#s.held, retiring => S#s.retiring,
           workers => maps:size(S#s.workers), core => S#s.core,
           %% nodes this lane keeps anything for (queues, counters, routes)
           known_nodes => length(lists:usort(convoy_batch:nodes(S#s.core)
                                             ++ maps:keys(S#s.refs)
                                             ++ maps:keys(S#s.segments)
                                             ++ maps:keys(S#s.routes)))}}.

-spec system_code_change(#s{}, module(), term(), term()) -> {ok, #s{}}.
system_code_change(S, _Module, _OldVsn, _Extra) -> {ok, S}.
