%% @private
%% An outbound lane: collects what senders hand it for its destination node (each
%% node has lanes of its own, see `convoy_lanes') and ships that queue as one
%% distribution message as soon as its mailbox is drained (or after `max_delay'
%% microseconds, or at `max_batch'). Its core keeps a queue per node: a lane
%% serves one.
%%
%% This process is the shell around `convoy_lane_core', which makes every decision
%% (what to queue, what ships when, what a disposal gives back, whom to wake or
%% answer, the hold/retire machine). The shell reads its mailbox, checks each
%% message's shape, gathers the facts an event needs and carries out the core's
%% actions: sends, counters (`convoy_metrics', `convoy_held', `convoy_slots'),
%% telemetry and helper processes.
%%
%% It sends with `[nosuspend, noconnect]':
%% <ul>
%% <li>`nosuspend' (the node's distribution buffer is full): the lane makes the
%%   blocking send itself and waits, as a sender's `!' would. Its node's lanes
%%   are the node's alone, so only that node's traffic waits with it; what its
%%   senders hand over meanwhile waits in its mailbox, off its heap, within the
%%   node's bounds. From the first send that waits until a chunk leaves nothing
%%   behind it, the node is `busy' (telemetry), and under `compress => auto'
%%   its batches are metered (`convoy_meter'). A stopping lane does not
%%   wait: what cannot leave at once is counted as dropped;</li>
%% <li>`noconnect': the chunk goes back to its queue and a connector process asks
%%   `net_kernel' for a connection, as `!' would; if that fails, the node's queue is
%%   dropped and counted.</li>
%% </ul>
%% Peers that run a compatible convoy get batches in their inbox (compressed under
%% the `compress' setting when the peer reads them and it pays, see
%% `convoy_compress'); others get plain sends, one per message. A publish entry
%% (`convoy:publish/3') goes as it is to a peer at protocol version 2; a
%% version-1 peer gets multicast entries, and a plain one plain sends, to the
%% group's members on that node as this node sees them when the lane ships.
%%
%% Lanes are retired and replaced when `lanes' changes at run time and when convoy
%% stops; see `convoy_control' for the protocol (hold, retire, release). Messages
%% from convoy_control carry a secret reference given at start, so a stray copy of
%% one cannot hold, release or retire a lane.
%%
%% A node marked unanswered (a sender's wait for it ran out, see
%% `convoy_metrics:unanswered/2') is probed by the lanes: a barrier tagged with
%% the lane's secret, behind a batch or alone, until the node answers and the
%% mark is cleared (`convoy_lane_probe').
%%
%% Helpers (connectors, barrier senders) are linked: they report their result as
%% their exit reason, and a lane that is killed takes them with it.
-module(convoy_lane).

-export([start_link/4]).
-export([init/5, system_continue/3, system_terminate/4, system_get_state/1,
         system_code_change/4]).

-include("convoy_runtime.hrl").
-include("convoy_tags.hrl").
-include_lib("kernel/include/logger.hrl").

-define(DRAIN_BUDGET, 10000).
%% A lane that shipped a large message collects its heap once it has been idle
%% this long (ms): a stream of large messages is left to the ordinary collections
%% its heap growth triggers (a full sweep per cycle cost more than a distribution
%% send of a 64 KiB message), while a lane that goes quiet does not keep the last
%% copies.
-define(GC_IDLE_MS, 10).
%% At shutdown, how long to wait for a sender admitted just before the lane closed
%% (it is between its admission and its send: microseconds, unless descheduled).
-define(LATE_SENDER_MS, 200).
%% At shutdown, how long to wait for peers' inboxes to confirm delivery.
-define(SHUTDOWN_BARRIER_MS, 2000).

%% Connectors report their result as their exit reason, and
%% terminate/2 and a retired lane end the process: all end by exit on purpose.
-dialyzer({nowarn_function, [connect/2, connector/1, terminate/2, cycle/1]}).
-define(SEND_OPTS, [nosuspend, noconnect]).
%% A send or large message as convoy_send hands it over; anything else (anything
%% may reach a registered process) is stray.
-define(IS_HANDED(Node, To, Bytes),
        is_atom(Node), is_integer(Bytes), Bytes >= 0,
        (is_pid(To) orelse is_atom(To) orelse is_reference(To))).

-record(s, {index :: pos_integer(),
            parent :: pid(),
            %% convoy_control's pid and the secret its messages carry
            control :: {pid(), reference()},
            core :: convoy_lane_core:core(),
            %% settings as published (re-read each cycle)
            rt :: #runtime{},
            %% this lane's own admission counters
            slots :: convoy_slots:slots(),
            %% counters and held counts of the nodes the lane holds messages for
            refs = #{} :: #{node() => {counters:counters_ref(), convoy_held:held()}},
            %% linked helpers, by pid
            workers = #{} :: #{pid() => {connector, node()} | {barrier, node()} | meter},
            %% per node in a busy run (from a send that waited until a chunk
            %% leaves nothing behind it, `resumed/3'): since when (native time),
            %% and under `compress => auto' its run's tag and the number of the
            %% last batch metered
            busy = #{} :: #{node() => {integer(), reference(), non_neg_integer()}},
            %% stopping: a busy connection is not waited for
            stopping = false :: boolean(),
            %% a large message left: collect its copy once the lane is idle (GC_IDLE_MS)
            gc = false :: boolean(),
            %% the route each node had when this lane last shipped to it
            routes = #{} :: #{node() => plain | {convoy, pos_integer(), tuple()}},
            %% every barrier of a retirement answered: the lane goes at the cycle's end
            retired = false :: boolean(),
            %% nodes marked unanswered: when (ms) a probe (a barrier tagged with
            %% the secret) was last sent to each, see `convoy_lane_probe'
            probes = #{} :: convoy_lane_probe:probes(),
            probe_secret = make_ref() :: reference(),
            %% under `compress => auto', what says whether busy batches pay compressed
            meter = none :: none | convoy_meter:meter(),
            %% senders waiting for a barrier's answer whose admission this lane
            %% disposes of when the wait ends or the sender dies: their monitors
            owed = #{} :: #{pid() => reference()}}).

%% Held: `none', `all' (nodes are released by convoy_control) or a list of nodes.
-spec start_link(pos_integer(), none | all | [node()], #runtime{}, {pid(), reference()}) ->
          {ok, pid()}.
start_link(Index, Held, RT, Control) ->
    proc_lib:start_link(?MODULE, init, [self(), Index, Held, RT, Control]).

-spec init(pid(), pos_integer(), none | all | [node()], #runtime{}, {pid(), reference()}) ->
          no_return().
init(Parent, Index, Held, RT = #runtime{max_batch = MB, max_delay = MD}, Control) ->
    process_flag(message_queue_data, off_heap),
    process_flag(trap_exit, true),
    proc_lib:init_ack(Parent, {ok, self()}),
    AutoConnect = application:get_env(kernel, dist_auto_connect, always) =/= never,
    loop(#s{index = Index, parent = Parent, control = Control, rt = RT,
            core = convoy_lane_core:new(Held, {MB, MD}, AutoConnect),
            slots = element(Index, RT#runtime.slots)}).

%% Settings are re-read when the lane wakes and at the end of each drain, so a
%% set_config/1 that has returned applies to everything the lane does next. One
%% clock reading serves a whole drain (it stamps when queued messages arrived).
loop(S) ->
    CoreTimeout = convoy_lane_core:timeout(now_us(), S#s.core),
    receive
        Msg ->
            Now = now_us(),
            drain(handle(Msg, Now, refresh(S)), Now, ?DRAIN_BUDGET)
    after idle_timeout(CoreTimeout, S) ->
        loop(collect(CoreTimeout, cycle(S)))
    end.

idle_timeout(CoreTimeout, S = #s{gc = true}) -> min(probe_timeout(CoreTimeout, S), ?GC_IDLE_MS);
idle_timeout(CoreTimeout, S) -> probe_timeout(CoreTimeout, S).

probe_timeout(CoreTimeout, #s{probes = Probes, rt = #runtime{barrier_timeout = T}}) ->
    convoy_lane_probe:timeout(CoreTimeout, T, Probes).

%% Probes due again (`convoy_lane_probe').
reprobe(S = #s{probes = Probes}) when map_size(Probes) =:= 0 ->
    S;
reprobe(S = #s{probes = Probes, probe_secret = Secret, index = I,
               rt = #runtime{barrier_timeout = T}}) ->
    S#s{probes = convoy_lane_probe:due(I, Secret, T, Probes)}.

refresh(S = #s{rt = Own}) ->
    case persistent_term:get(?RUNTIME_KEY, Own) of
        Own ->
            S;
        RT = #runtime{max_batch = MB, max_delay = MD} ->
            core({settings, MB, MD}, now_us(), S#s{rt = RT})
    end.

drain(S, Now, N) ->
    drain(S, Now, N, [], 0).

%% Sends read back to back go to the core together, newest first (one event for
%% up to max_batch of them rather than one each); anything else is handed in after
%% them, so the core sees everything in the order it was read.
drain(S, Now, 0, Sends, K) ->
    loop(cycle(pend(Sends, K, Now, S)));
drain(S = #s{rt = #runtime{max_batch = MB}}, Now, N, Sends, K) when K >= MB ->
    drain(pend(Sends, K, Now, S), Now, N, [], 0);
drain(S, Now, N, Sends, K) ->
    receive
        {?TAG_SEND, Node, To, _Msg, Bytes} = M when ?IS_HANDED(Node, To, Bytes) ->
            drain(S, Now, N - 1, [M | Sends], K + 1);
        Msg ->
            drain(handle(Msg, Now, pend(Sends, K, Now, S)), Now, N - 1, [], 0)
    after 0 ->
        loop(cycle(pend(Sends, K, Now, S)))
    end.

pend(_Sends, 0, _Now, S) -> S;
pend(Sends, K, Now, S) -> core({sends, Sends, K}, Now, S).

%% Always the real time: the monotonic clock can be negative, so no constant can
%% stand for "no time".
now_us() -> erlang:monotonic_time(microsecond).

%% End of a drain: ship what is due; a retiring lane checks whether every
%% admission it granted is disposed of, and goes once its barriers are answered.
cycle(S0) ->
    S1 = core(cycle, now_us(), reprobe(refresh(S0))),
    S2 = case convoy_lane_core:draining(S1#s.core) of
             true -> core({admissions_disposed, convoy_slots:disposed(S1#s.slots)}, now_us(), S1);
             false -> S1
         end,
    case S2 of
        #s{retired = true, control = {Control, Secret}} ->
            Control ! {?TAG_RETIRED, Secret, self()},
            exit(normal);
        _ ->
            S2
    end.

%% The lane was idle for GC_IDLE_MS (not woken for the core's own timeout).
collect(CoreTimeout, S = #s{gc = true}) when CoreTimeout > ?GC_IDLE_MS ->
    true = erlang:garbage_collect(),
    S#s{gc = false};
collect(_CoreTimeout, S) ->
    S.

%% Hand an event to the core and carry out its actions, in order.
core(Event, Now, S) ->
    case convoy_lane_core:handle(Event, Now, S#s.core) of
        {Core, []} -> S#s{core = Core}; % most sends: queued, nothing to do yet
        {Core, Actions} -> acts(Actions, Now, S#s{core = Core})
    end.

acts([], _Now, S) -> S;
acts([A | Rest], Now, S) -> acts(Rest, Now, act(A, Now, S)).

%%--------------------------------------------------------------------
%% Messages

%% Sends come from convoy_send in this node's processes; the guards keep a
%% malformed one (anything may reach a registered process) from crashing the lane.
handle({?TAG_SEND, Node, To, _Msg, Bytes} = M, Now, S) when ?IS_HANDED(Node, To, Bytes) ->
    core({send, M}, Now, S);
handle({?TAG_SENDS, Sends, K}, Now, S) when is_list(Sends), is_integer(K), K > 0 ->
    %% convoy:send_many/1: sends newest first, as a drain collects them
    case counted_sends(Sends, 0) of
        K -> core({sends, Sends, K}, Now, S);
        _ -> stray(S)
    end;
handle({?TAG_LARGE, Node, To, _Msg, Bytes} = M, Now, S) when ?IS_HANDED(Node, To, Bytes) ->
    core({send, M}, Now, S);
handle({Kind, Node, Tos, _Msg, Bytes} = M, Now, S)
  when Kind =:= ?TAG_MULTICAST orelse Kind =:= ?TAG_LARGE,
       is_atom(Node), is_integer(Bytes), Bytes >= 0, is_list(Tos) ->
    case valid_tos(Tos) of
        true -> core({send, M}, Now, S);
        false -> stray(S)
    end;
handle({Kind, Node, {?TAG_PUBLISH, Scope, _Group}, _Msg, Bytes} = M, Now, S)
  when Kind =:= ?TAG_MULTICAST orelse Kind =:= ?TAG_LARGE,
       is_atom(Node), is_integer(Bytes), Bytes >= 0, is_atom(Scope) ->
    core({send, M}, Now, S);
handle({?TAG_WAIT, Node, Alias, Bytes}, Now, S = #s{rt = RT})
  when is_atom(Node), is_reference(Alias), is_integer(Bytes), Bytes >= 0 ->
    {_, H} = refs(Node, S),
    core({wait, Node, Alias, convoy_held:has_room(H, Bytes, RT)}, Now, S);
handle({?TAG_OWED, Pid}, _Now, S = #s{owed = Owed})
  when is_pid(Pid), node(Pid) =:= node(), not is_map_key(Pid, Owed) ->
    S#s{owed = Owed#{Pid => erlang:monitor(process, Pid)}};
handle({?TAG_OWED_DONE, Pid}, _Now, S = #s{owed = Owed}) when is_map_key(Pid, Owed) ->
    true = erlang:demonitor(maps:get(Pid, Owed), [flush]),
    owed_disposed(Pid, S);
handle({'DOWN', Mon, process, Pid, _}, _Now, S = #s{owed = Owed})
  when map_get(Pid, Owed) =:= Mon ->
    owed_disposed(Pid, S);
handle({?TAG_FLUSH, Which, ReplyTo, Tag}, Now, S)
  when is_atom(Which), is_pid(ReplyTo) orelse is_reference(ReplyTo) ->
    core({flush, Which, ReplyTo, Tag}, Now, S);
handle({'EXIT', Parent, Reason}, _Now, S = #s{parent = Parent}) ->
    terminate(Reason, S);
handle({'EXIT', Pid, Reason}, Now, S = #s{workers = W}) when is_map_key(Pid, W) ->
    worker_done(maps:get(Pid, W), Reason, Now, S#s{workers = maps:remove(Pid, W)});
handle({?TAG_HOLD, Secret, Nodes}, Now, S = #s{control = {_, Secret}}) when is_list(Nodes) ->
    core({hold, [N || N <- Nodes, is_atom(N)]}, Now, S);
handle({?TAG_RELEASE, Secret, Node}, Now, S = #s{control = {_, Secret}}) when is_atom(Node) ->
    core({release, Node}, Now, S);
handle({?TAG_RETIRE, Secret, K}, Now, S = #s{control = {_, Secret}})
  when is_integer(K), K >= 0 ->
    core({retire, K}, Now, S);
handle({{Secret, Node}, convoy_barrier}, _Now, S = #s{probe_secret = Secret}) when is_atom(Node) ->
    S#s{probes = convoy_lane_probe:answered(Node, S#s.probes)};
handle({?TAG_PROBE, Node}, _Now, S = #s{probes = Probes, probe_secret = Secret, index = I})
  when is_atom(Node) ->
    S#s{probes = convoy_lane_probe:first(Node, I, Secret, Probes)};
handle({system, From, Req}, _Now, S) ->
    sys:handle_system_msg(Req, From, S#s.parent, ?MODULE, [], S);
handle(_Other, _Now, S) ->
    stray(S).

%% A sender's admission held across its wait (`convoy_wait:barrier/7'): disposed
%% of once, when the wait ends or the sender dies, whichever comes first.
owed_disposed(Pid, S = #s{owed = Owed, slots = Slots}) ->
    ok = convoy_slots:dispose(Slots, 1),
    S#s{owed = maps:remove(Pid, Owed)}.

%% Stray, duplicated or malformed: counted, never fatal.
stray(S) ->
    convoy_metrics:rejected(unknown_message),
    S.

%% How many well-formed sends, or `bad'.
counted_sends([], N) -> N;
counted_sends([{?TAG_SEND, Node, To, _Msg, Bytes} | Rest], N) when ?IS_HANDED(Node, To, Bytes) ->
    counted_sends(Rest, N + 1);
counted_sends(_, _N) -> bad.

valid_tos([]) -> true;
valid_tos([To | Rest]) when is_pid(To); is_atom(To); is_reference(To) -> valid_tos(Rest);
valid_tos(_) -> false.

%%--------------------------------------------------------------------
%% Actions

act({accepted, Node, K}, _Now, S = #s{refs = Refs}) ->
    {C, _} = R = accepting_refs(Node, S),
    convoy_metrics:add(C, accepted, K),
    S#s{refs = Refs#{Node => R}};
act({ship, Node, Wire, {Msgs, _} = Size, _Reason}, Now, S) ->
    {Route, S1} = route(Node, S),
    {Outcome, S2} = ship(Node, Route, {Wire, Size}, S1),
    core({shipped, Node, Outcome}, Now, resumed(Node, Msgs, S2));
act({sent, Node, Msgs, Sends, Reason, Route}, _Now, S = #s{index = I, rt = RT, slots = Slots}) ->
    %% What batching achieves, for senders to decide whether the lane pays.
    ok = convoy_slots:record_batch(Slots, Msgs, Sends, convoy_slots:now_us(RT#runtime.clock)),
    C = counters(Node, S),
    convoy_metrics:add(C, messages, Msgs),
    convoy_metrics:add(C, batches, Sends),
    event(RT, [convoy, batch, sent], #{count => Msgs, sends => Sends},
          #{node => Node, lane => I, reason => Reason, route => Route}),
    S;
act({dropped, Node, Msgs, Why}, _Now, S = #s{index = I, rt = RT}) ->
    convoy_metrics:add(counters(Node, S), dropped, Msgs),
    event(RT, [convoy, batch, dropped], #{count => Msgs}, #{node => Node, lane => I, reason => Why}),
    S;
act({disposed, Node, K, Bytes}, _Now, S = #s{slots = Slots}) ->
    {_, H} = refs(Node, S),
    ok = convoy_held:release(H, K, Bytes),
    ok = convoy_slots:dispose(Slots, K),
    S;
act({wake, Alias}, _Now, S) ->
    Alias ! {Alias, room},
    S;
act({reply, ReplyTo, Tag}, _Now, S) ->
    ReplyTo ! {Tag, ok},
    S;
act({connect, Node}, _Now, S) ->
    connect(Node, S);
act({forget, Node}, _Now, S = #s{routes = Routes}) ->
    %% Counters are fetched again when needed, so a row convoy_peers has forgotten
    %% is never written to; a convoy route stays for shutdown barriers until a
    %% lookup finds the node plain.
    forget_meter(Node, S#s{refs = maps:remove(Node, S#s.refs),
                           busy = maps:remove(Node, S#s.busy),
                           routes = case Routes of
                                        #{Node := plain} -> maps:remove(Node, Routes);
                                        _ -> Routes
                                    end});
act({dispose, K}, _Now, S = #s{slots = Slots}) ->
    ok = convoy_slots:dispose(Slots, K),
    S;
act(start_barriers, Now, S = #s{control = {Control, Secret}}) ->
    Nodes = convoy_peers:convoy_nodes(),
    Control ! {?TAG_RETIRING, Secret, self(), Nodes},
    S1 = lists:foldl(fun retire_barrier/2, S, Nodes),
    core({barriers, Nodes}, Now, S1);
act(retired, _Now, S) ->
    S#s{retired = true};
act({stray, _Event}, _Now, S) ->
    stray(S).

counters(Node, S) ->
    element(1, refs(Node, S)).

refs(Node, #s{refs = Refs}) ->
    case Refs of
        #{Node := R} -> R;
        _ -> node_refs(Node)
    end.

%% The refs a run is accepted under. A row is forgotten (closed) only when it
%% holds nothing, so nothing the lane holds belongs to a closed one: its next
%% messages go to the node's new row.
accepting_refs(Node, #s{refs = Refs}) ->
    case Refs of
        #{Node := {_C, H} = R} ->
            case convoy_held:is_closed(H) of
                false -> R;
                true -> node_refs(Node)
            end;
        _ ->
            node_refs(Node)
    end.

%% While convoy's tree is torn down (no convoy_peers) counts go to counters of the
%% lane's own, which its shutdown summary reports.
node_refs(Node) ->
    case convoy_peers:refs(Node) of
        undefined -> convoy_metrics:new_refs();
        Refs -> Refs
    end.

event(#runtime{telemetry = On}, Name, Measurements, Meta) ->
    convoy_metrics:emit(On, Name, Measurements, Meta).

%%--------------------------------------------------------------------
%% Shipping a chunk: returns its outcome (convoy_lane_core:outcome()).

%% The route last seen is kept: while convoy's tree is torn down (node table gone)
%% the lane still ships what it holds, and confirms it (shutdown barriers).
route(Node, S = #s{routes = Routes}) ->
    case convoy_peers:known_route(Node) of
        unknown -> {maps:get(Node, Routes, unknown), S};
        Route -> {Route, S#s{routes = Routes#{Node => Route}}}
    end.

%% Large messages never share a batch with small ones (a chunk is a run of them)
%% and are never compressed; their copies in the lane's heap are collected once
%% the lane is idle (see GC_IDLE_MS). A chunk: its messages and their size, how
%% many and their encoded bytes, as the core counted them.
ship(Node, Route, {[{?TAG_LARGE, _, _} | _], _Size} = Chunk, S) ->
    ship_route(Node, Route, Chunk, S#s{gc = true});
ship(Node, Route, Chunk, S) ->
    ship_route(Node, Route, Chunk, S).

ship_route(_Node, unknown, _Chunk, S) ->
    {unroutable, S};
ship_route(Node, {convoy, Vsn, Inboxes}, {[{?TAG_LARGE, _, _} | _] = Wire, _Size},
           S0 = #s{index = I}) ->
    Target = {convoy_wire:lane_inbox(I, Inboxes), Node},
    {Probe, S} = probe(Node, S0),
    ship_run(Node, Target, Vsn, Probe, convoy_batch:run_groups(Wire), 0, 0, S);
ship_route(Node, {convoy, Vsn, Inboxes}, {Wire, {Msgs, _Bytes} = Size}, S0 = #s{index = I}) ->
    Target = {convoy_wire:lane_inbox(I, Inboxes), Node},
    {Probe, S1} = probe(Node, S0),
    {Batch, Zipped, S2} = batch(Node, Vsn, convoy_lane_wire:entries(Wire, Vsn, Node) ++ Probe,
                                Size, S1),
    case send(Node, Target, Batch, Msgs, S2) of
        {ok, S} -> {{sent, 1, convoy}, compressed(Node, Zipped, S)};
        {Failed, S} -> {{Failed, 0, 0, Wire, convoy}, S}
    end;
ship_route(Node, plain, {Wire, _Size}, S) ->
    plain(Node, Wire, 0, 0, S).

%% A chunk's batch, compressed or not (`convoy_compress'): under `compress =>
%% auto', in the node's busy run when the peer meters, at the level its meter
%% gives, with a meter behind its entries; otherwise at the setting's level.
batch(Node, Vsn, Entries, Size = {Msgs, _}, S0 = #s{busy = Busy})
  when is_map_key(Node, Busy) ->
    case is_metered(Vsn, S0) of
        true ->
            S = #s{meter = M} = meter(Node, S0),
            {Since, Run, Seq} = maps:get(Node, Busy),
            {ReplyTo, Level} = convoy_meter:level(M),
            Tag = {Run, Seq + 1, case Level of never -> plain; _ -> zip end, Msgs},
            Meter = convoy_wire:meter(ReplyTo, {S#s.probe_secret, Node, Tag}),
            {Batch, Zipped} = convoy_compress:shipped(node(), Entries ++ [Meter], Size, Level, Vsn),
            {Batch, Zipped, S#s{busy = Busy#{Node := {Since, Run, Seq + 1}}}};
        false ->
            unmetered(Vsn, Entries, Size, S0)
    end;
batch(_Node, Vsn, Entries, Size, S) ->
    unmetered(Vsn, Entries, Size, S).

unmetered(Vsn, Entries, Size, S) ->
    {Batch, Zipped} = convoy_compress:shipped(node(), Entries, Size, now_level(S), Vsn),
    {Batch, Zipped, S}.

%% The level a batch is compressed at outside a busy run: under `auto',
%% none (the connection took the last one at once: not the limit now).
now_level(#s{rt = #runtime{compress = auto}}) -> never;
now_level(#s{rt = #runtime{compress = Compress}}) -> Compress.

%% The node's meter (`convoy_meter'), started with its first metered batch.
meter(_Node, S = #s{meter = M}) when M =/= none ->
    S;
meter(Node, S = #s{index = I, probe_secret = Secret, rt = RT}) ->
    M = convoy_meter:start_link(Node, I, Secret, RT#runtime.telemetry),
    S#s{meter = M, workers = (S#s.workers)#{convoy_meter:pid(M) => meter}}.

%% What a node's meter measured holds while it is connected (forgetting an idle
%% node is a lane's routine).
forget_meter(Node, S = #s{meter = M}) when M =/= none ->
    case lists:member(Node, nodes(connected)) of
        true -> S;
        false -> ok = convoy_meter:stop(M),
                 S#s{meter = none, workers = maps:remove(convoy_meter:pid(M), S#s.workers)}
    end;
forget_meter(_Node, S) ->
    S.

%% Under `auto', a convoy peer that reads compressed batches and meters gets its
%% batches metered while its connection is busy (`convoy_compress_auto').
is_metered(Vsn, #s{rt = #runtime{compress = auto}}) -> convoy_wire:supports(Vsn, meter);
is_metered(_Vsn, _S) -> false.

%% A compressed batch that left counted and reported once: one that could not
%% leave (not connected) goes back to the queue and is compressed again when it
%% ships.
compressed(_Node, plain, S) ->
    S;
compressed(Node, {Msgs, In, Out}, S = #s{rt = RT}) ->
    C = counters(Node, S),
    convoy_metrics:add(C, compressed_batches, 1),
    convoy_metrics:add(C, compressed_bytes_in, In),
    convoy_metrics:add(C, compressed_bytes_out, Out),
    event(RT, [convoy, batch, compressed], #{entries => Msgs, bytes_in => In, bytes_out => Out},
          #{node => Node}),
    S.

%% A run of large messages, in groups of one distribution message each
%% (convoy_batch:run_groups/1), one after the other, the probe (`probe/2') behind
%% the last.
ship_run(_Node, _Target, _Vsn, _Probe, [], _Msgs, Sends, S) ->
    {{sent, Sends, convoy}, S};
ship_run(Node, Target, Vsn, Probe, [G | Rest] = Groups, Msgs, Sends, S0) ->
    case send(Node, Target, run_batch(G, Rest, Vsn, Node, Probe), length(G), S0) of
        {ok, S} -> ship_run(Node, Target, Vsn, Probe, Rest, Msgs + length(G), Sends + 1, S);
        {Failed, S} -> {{Failed, Msgs, Sends, lists:append(Groups), convoy}, S}
    end.

run_batch(Group, [], Vsn, Node, Probe) ->
    convoy_wire:batch(node(), convoy_lane_wire:entries(Group, Vsn, Node) ++ Probe);
run_batch(Group, _More, Vsn, Node, _Probe) ->
    convoy_wire:batch(node(), convoy_lane_wire:entries(Group, Vsn, Node)).

%% The probe (`convoy_lane_probe') behind a batch to Node, if it is marked.
probe(Node, S = #s{probes = Probes, probe_secret = Secret, rt = #runtime{barrier_timeout = T}}) ->
    {Probe, Probes1} = convoy_lane_probe:behind(Node, counters(Node, S), Secret, T, Probes),
    {Probe, S#s{probes = Probes1}}.

%% Plain sends, entry by entry, for peers without a compatible convoy.
plain(_Node, [], _Msgs, Sends, S) ->
    {{sent, Sends, plain}, S};
plain(Node, [E | Rest], Msgs, Sends, S0) ->
    case convoy_lane_wire:plain_entry(E, Node) of
        {Tos, Msg} when is_list(Tos) ->
            case plain_multi(Node, Tos, Msg, 0, S0) of
                {ok, K, S} ->
                    plain(Node, Rest, Msgs + 1, Sends + K, S);
                {Failed, K, Left, S} ->
                    {{Failed, Msgs, Sends + K, [{Left, Msg} | Rest], plain}, S}
            end;
        {To, Msg} ->
            case send(Node, convoy_wire:address(To, Node), Msg, 1, S0) of
                {ok, S} -> plain(Node, Rest, Msgs + 1, Sends + 1, S);
                {Failed, S} -> {{Failed, Msgs, Sends, [E | Rest], plain}, S}
            end
    end.

plain_multi(_Node, [], _Msg, K, S) ->
    {ok, K, S};
plain_multi(Node, [To | Rest] = Tos, Msg, K, S0) ->
    case send(Node, convoy_wire:address(To, Node), Msg, 1, S0) of
        {ok, S} -> plain_multi(Node, Rest, Msg, K + 1, S);
        {Failed, S} -> {Failed, K, Tos, S}
    end.

%% One send of a chunk, of `Msgs' messages: at once, or after the lane waited out
%% the node's busy connection (`busy' when a stopping lane does not wait).
send(Node, Dest, Term, Msgs, S) ->
    case erlang:send(Dest, Term, ?SEND_OPTS) of
        ok -> {ok, S};
        noconnect -> {unconnected, S};
        nosuspend when S#s.stopping -> {busy, S};
        nosuspend -> wait_send(Node, Dest, Term, Msgs, S)
    end.

wait_send(Node, Dest, Term, Msgs, S0 = #s{busy = Busy, index = I, rt = RT}) ->
    S = case Busy of
            #{Node := _} ->
                S0;
            _ ->
                event(RT, [convoy, node, busy], #{count => Msgs}, #{node => Node, lane => I}),
                S0#s{busy = Busy#{Node => {erlang:monotonic_time(), make_ref(), 0}}}
        end,
    case erlang:send(Dest, Term, [noconnect]) of
        ok -> {ok, S};
        noconnect -> {unconnected, S}
    end.

%% A node's busy run ends with a chunk that left nothing behind it: its queue
%% empty (the chunk shorter than `max_batch') and nothing more handed over
%% meanwhile (the lane's mailbox empty).
resumed(Node, Msgs, S = #s{busy = Busy, index = I, rt = RT = #runtime{max_batch = MB}})
  when Msgs < MB, is_map_key(Node, Busy) ->
    case process_info(self(), message_queue_len) of
        {message_queue_len, 0} ->
            {Since, _, _} = maps:get(Node, Busy),
            event(RT, [convoy, node, resumed], #{duration => erlang:monotonic_time() - Since},
                  #{node => Node, lane => I}),
            S#s{busy = maps:remove(Node, Busy)};
        _ ->
            S
    end;
resumed(_Node, _Msgs, S) ->
    S.

%%--------------------------------------------------------------------
%% Connectors, barrier senders

connect(Node, S) ->
    Pid = spawn_link(fun() -> connector(Node) end),
    S#s{workers = (S#s.workers)#{Pid => {connector, Node}}}.

connector(Node) ->
    exit({connected, net_kernel:connect_node(Node)}).

worker_done(meter, _Reason, _Now, S = #s{meter = M}) ->
    ok = convoy_meter:stop(M), % killed from outside: the next busy batch starts another
    S#s{meter = none};
worker_done({connector, Node}, Reason, Now, S) ->
    core({connected, Node, Reason =:= {connected, true}}, Now, S);
worker_done({barrier, Node}, _Reason, Now, S = #s{control = {Control, Secret}}) ->
    Control ! {?TAG_NODE_DONE, Secret, self(), Node},
    core({barrier_done, Node}, Now, S).

%% A helper process sends the barrier (blocking: it may wait out a busy buffer) and
%% ends when the inbox answers or cannot (node or inbox gone, or no longer a convoy
%% peer).
retire_barrier(Node, S = #s{index = I}) ->
    Pid = spawn_link(fun() -> barrier(I, Node, convoy_peers:known_route(Node)) end),
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
%% A barrier still waiting at the deadline (a stalled peer) is killed: nothing of
%% the lane outlives it.
shutdown_barriers(#s{index = I, routes = Routes}) ->
    Deadline = erlang:monotonic_time(millisecond) + ?SHUTDOWN_BARRIER_MS,
    Helpers = [spawn_monitor(fun() -> barrier(I, Node, Route) end)
               || {Node, {convoy, _, _} = Route} <- maps:to_list(Routes)],
    lists:foreach(fun({Pid, Mon}) ->
                          receive
                              {'DOWN', Mon, process, _, _} -> ok
                          after max(0, Deadline - erlang:monotonic_time(millisecond)) ->
                              erlang:demonitor(Mon, [flush]),
                              exit(Pid, kill)
                          end
                  end, Helpers).

%%--------------------------------------------------------------------
%% Shutdown (convoy stops, or its tree is torn down): everything handed over
%% before is read from the mailbox, what can leave without waiting leaves, and the
%% rest is counted as dropped and logged.

terminate(Reason, S) ->
    _ = convoy_slots:close(S#s.slots),
    S0 = read_mailbox(S#s{stopping = true}),
    Before = dropped_counts(S0),
    S1 = core(shutdown_ship, now_us(), S0),
    _ = [begin true = unlink(Pid), true = exit(Pid, kill) end
         || Pid <- maps:keys(S1#s.workers)],
    S2 = core(shutdown_drop, now_us(), S1#s{workers = #{}}),
    ok = shutdown_barriers(S2),
    After = dropped_counts(S2),
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
        M -> read_mailbox(handle(M, now_us(), S), Deadline)
    after 0 ->
        Outstanding = convoy_slots:admitted(Slots) - convoy_slots:disposed(Slots)
            - convoy_lane_core:holding(S#s.core),
        case Outstanding > 0 andalso erlang:monotonic_time(millisecond) < Deadline of
            true -> receive after 1 -> read_mailbox(S, Deadline) end;
            false -> S
        end
    end.

dropped_counts(S = #s{refs = Refs}) ->
    maps:map(fun(Node, _) ->
                     maps:get(dropped, convoy_metrics:node_info(counters(Node, S)))
             end, Refs).

%%--------------------------------------------------------------------
%% sys

-spec system_continue(pid(), [sys:debug_option()], #s{}) -> no_return().
system_continue(_Parent, _Debug, S) -> drain(S, now_us(), ?DRAIN_BUDGET). % ship once drained

-spec system_terminate(term(), pid(), [sys:debug_option()], #s{}) -> no_return().
system_terminate(Reason, _Parent, _Debug, S) -> terminate(Reason, S).

-spec system_get_state(#s{}) -> {ok, map()}.
system_get_state(S = #s{core = Core}) ->
    {ok, (convoy_lane_core:summary(Core))#{
           index => S#s.index, workers => maps:size(S#s.workers), core => Core,
           busy => maps:keys(S#s.busy),
           %% under `compress => auto', each measured node's mode and answers
           compress => convoy_meter:summary(S#s.meter),
           %% nodes this lane keeps anything for (queues, counters, routes)
           known_nodes => length(lists:usort(convoy_lane_core:nodes(Core)
                                             ++ maps:keys(S#s.refs)
                                             ++ maps:keys(S#s.routes)))}}.

-spec system_code_change(#s{}, module(), term(), term()) -> {ok, #s{}}.
system_code_change(S, _Module, _OldVsn, _Extra) -> {ok, S}.
