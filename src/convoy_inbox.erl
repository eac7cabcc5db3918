%% @private
%% An inbound lane: registered as `convoy_inbox_I', it takes batches from peers'
%% lanes (see `convoy_wire') and delivers their entries, in order, with local sends.
%% The decisions are its core's (`convoy_inbox_core'): this process reads its
%% mailbox, gathers the facts an input needs, and carries out the actions.
%%
%% A connected node is trusted, but what reaches an inbox may be stray, duplicated,
%% misdirected or malformed: batches of unknown versions, from nodes that are not
%% connected, malformed entries, barriers for a third node, multicasts over the
%% limits, destinations of an old incarnation of this node and stray terms are
%% counted (see `convoy:info/0', `rejected') and the first of each kind is logged
%% (`undeliverable' is only counted); the valid entries of a batch are still
%% delivered. A compressed batch (`convoy_compress') is decoded here and takes
%% the plain batch's path; one that does not decode to a list of entries is
%% counted `bad_compressed' and nothing of it is delivered.
%%
%% Bounded work before other traffic gets its turn: a long batch is delivered in
%% slices (see `convoy_inbox_core'), and while some batch is unfinished the inbox
%% handles one message from its mailbox between slices. A batch of up to 8192
%% plain sends fits in one slice, so ordinary batches (`max_batch' 1000 by
%% default) are never split. Since a batch can be unfinished, `sys:get_state/1'
%% returning does not mean that all batches received so far were delivered; it
%% returns `convoy_inbox_core:summary/1'.
%%
%% Pieces of large messages (version 2, `convoy_chunk') are stored and acked as
%% they come; the last one delivers the whole message in its place. The inbox
%% watches the sender named in a message's first piece (see `convoy_chunk_send'):
%% its `DOWN' (and a `nodedown') discards the partial message, and so does its
%% moving on without it (it no longer monitors the inbox). Only the `DOWN' of a
%% watch the inbox holds, that of one of its couriers, a `nodedown' of a node
%% that is not connected and a tick of its own timer are acted on; any other is
%% counted (`unknown_message'), as anyone may send them.
%%
%% Never suspended by a connection: the inbox serves every node, and a stalled
%% node's full connection must not hold up the others' traffic. Its deliveries
%% are local sends; answers to a batch's node (barriers, pieces' acks) go through
%% `convoy_remote:send/3' (a courier waits out a busy connection, answers to a
%% node keep their order), and the monitor of a piece's sender is a watcher's
%% (`convoy_remote:watch/2'), dropped by killing it.
%%
%% This node's name and incarnation are read for each batch and slice, never
%% kept: convoy may start before the node is named (`net_kernel:start/1'), and
%% distribution may be restarted under another name; the pids and aliases of
%% this node in what is stored (decoded on arrival) follow the name.
-module(convoy_inbox).

-export([start_link/1, init/2, system_continue/3, system_terminate/4,
         system_get_state/1, system_code_change/4]).

-include("convoy_runtime.hrl").
-include("convoy_tags.hrl").

%% The message of the pieces' tick timer.
-define(TICK, convoy_chunk_tick).

-record(s, {parent :: pid(),
            %% this inbox's slot in the bound on partial messages per node
            slot :: convoy_chunk_bound:slot(),
            %% counters per peer node, cached until its nodedown
            peers = #{} :: #{node() => counters:counters_ref()},
            core :: convoy_inbox_core:core(),
            %% answers waiting for a busy connection, per node
            out = convoy_remote:new() :: convoy_remote:outbox(),
            %% the node whose batch the input at hand concerns (for the log)
            from = none :: node() | none}).

%% @doc Inbox `Index'.
-spec start_link(pos_integer()) -> {ok, pid()}.
start_link(Index) ->
    proc_lib:start_link(?MODULE, init, [self(), Index]).

-spec init(pid(), pos_integer()) -> no_return().
init(Parent, Index) ->
    register(convoy_wire:inbox_name(Index), self()),
    Slot = convoy_chunk_bound:join(Index),
    process_flag(message_queue_data, off_heap),
    process_flag(trap_exit, true),
    ok = net_kernel:monitor_nodes(true),
    proc_lib:init_ack(Parent, {ok, self()}),
    loop(#s{parent = Parent, slot = Slot, core = convoy_inbox_core:new()}).

%% With unfinished batches: one message, then one slice, in turn.
loop(S = #s{parent = Parent}) ->
    Wait = case convoy_inbox_core:busy(S#s.core) of
               true -> 0;
               false -> infinity
           end,
    receive
        {system, From, Req} ->
            sys:handle_system_msg(Req, From, Parent, ?MODULE, [], S);
        {'EXIT', Parent, Reason} ->
            exit(Reason);
        Msg when Wait =:= 0 ->
            loop(slice(handle(Msg, S)));
        Msg ->
            loop(handle(Msg, S))
    after Wait ->
        loop(slice(S))
    end.

slice(S) ->
    core({slice, here()}, S#s{from = convoy_inbox_core:turn(S#s.core)}).

%% This node's name and incarnation now (see the module header).
here() ->
    {node(), erlang:system_info(creation)}.

handle({nodedown, Node}, S) when is_atom(Node) ->
    case lists:member(Node, nodes(connected)) of
        false ->
            S1 = core({nodedown, Node}, S#s{from = Node}),
            S1#s{peers = maps:remove(Node, S1#s.peers)};
        true ->
            %% Forged, or from before a reconnection (whose monitors of the node's
            %% senders fired then): nothing to discard.
            stray(S)
    end;
handle({{?TAG_KEEPER_DOWN, Keeper}, Mon, process, Watcher, _Reason}, S)
  when is_pid(Keeper), is_reference(Mon), is_pid(Watcher) ->
    %% The core acts only on a watch it holds.
    core({down, {Watcher, Mon}, Keeper}, S#s{from = node(Keeper)});
handle({{?TAG_COURIER, Node}, Mon, process, _Pid, _Reason}, S) when is_reference(Mon) ->
    case convoy_remote:courier_done(Node, Mon, S#s.out) of
        {ok, Out} -> S#s{out = Out};
        unknown -> stray(S)
    end;
handle({nodeup, Node}, S) when is_atom(Node) ->
    S;
handle({timeout, TRef, ?TICK}, S) when is_reference(TRef) ->
    {monitored_by, Watching} = erlang:process_info(self(), monitored_by),
    core({tick, TRef, Watching, barrier_timeout()}, S#s{from = none});
handle(Msg, S) ->
    case convoy_wire:decode(Msg) of
        {batch, _Vsn, From, Entries} ->
            batch(From, Entries, S);
        {zbatch, _Vsn, From, Bin} ->
            %% Delivered as the batch it encodes, or refused whole.
            case convoy_compress:decode(Bin) of
                {ok, Entries} ->
                    batch(From, Entries, S);
                error ->
                    convoy_metrics:rejected(bad_compressed, #{from => From}),
                    S
            end;
        {error, Kind} ->
            convoy_metrics:rejected(Kind),
            S;
        {_HelloOrWelcome, _} ->
            stray(S)
    end.

stray(S) ->
    convoy_metrics:rejected(unknown_message),
    S.

batch(From, Entries, S) ->
    case peer(From, S) of
        {ok, C, S1} ->
            core({batch, From, C, Entries, here()}, S1#s{from = From});
        unknown ->
            convoy_metrics:rejected(unknown_node, #{from => From}),
            S
    end.

%% A batch must come from a connected peer (it cannot come from anywhere else).
%% The node's counters are cached until its nodedown: convoy_peers forgets only
%% rows of nodes that are not connected, so a cached row is never a forgotten one.
%% With no convoy_peers (convoy's tree is being torn down) counts go to counters
%% nobody reads.
peer(Node, S = #s{peers = Peers}) ->
    case Peers of
        #{Node := C} ->
            {ok, C, S};
        _ ->
            case lists:member(Node, nodes(connected)) of
                true ->
                    case convoy_peers:refs(Node) of
                        undefined ->
                            {ok, element(1, convoy_metrics:new_refs()), S};
                        {C, _H} ->
                            {ok, C, S#s{peers = Peers#{Node => C}}}
                    end;
                false ->
                    unknown
            end
    end.

%%--------------------------------------------------------------------
%% Actions

%% Hand an input to the core and carry out its actions, in order; a request (the
%% last action) is answered with the fact it asks for, as the next input.
core(Input, S) ->
    {Core, Actions} = convoy_inbox_core:handle(Input, S#s.core),
    acts(Actions, S#s{core = Core}).

acts([], S) ->
    S;
acts([{deliver, To, Msg} | Rest], S) ->
    send(To, Msg),
    acts(Rest, S);
acts([{deliver_each, Tos, Msg} | Rest], S) ->
    send_each(Tos, Msg),
    acts(Rest, S);
acts([{deliver_plain, Entries, Max, Good, Local}], S) ->
    {K, Rest, Good1, Dropped} = convoy_plain:run(Entries, Max, Good, Local, send),
    undeliverable(Dropped),
    core({delivered_plain, K, Rest, Good1}, S);
acts([{members, Scope, Group}], S) ->
    core({members, convoy_pg:local_members(Scope, Group)}, S);
acts([{monitor, Pid}], S) ->
    core({monitored, convoy_remote:watch(Pid, {?TAG_KEEPER_DOWN, Pid})}, S);
acts([{room, Node}], S) ->
    Bound = max_reassembly_bytes(),
    core({room, convoy_chunk_bound:room(S#s.slot, Node, Bound), Bound}, S);
acts([{reserve, Node, Old, Held, Bound}], S) ->
    core({reserved, convoy_chunk_bound:reserve(S#s.slot, Node, Old, Held, Bound)}, S);
acts([{start_timer, Ms}], S) ->
    core({timer, erlang:start_timer(Ms, self(), ?TICK)}, S);
acts([{assemble, Kind, Parts}], S) ->
    core({assembled, convoy_chunk:assemble(Kind, Parts)}, S);
acts([A | Rest], S) ->
    acts(Rest, act(A, S)).

act({deliver_all, To, Msgs}, S) ->
    lists:foreach(fun(M) -> send(To, M) end, Msgs),
    S;
act({publish, Members, Msgs}, S) ->
    ok = publish(Members, Msgs, node()),
    S;
act({barrier, ReplyTo, Tag}, S) ->
    S#s{out = convoy_remote:send(ReplyTo, {Tag, convoy_barrier}, S#s.out)};
act({meter, ReplyTo, Tag}, S) ->
    Time = erlang:monotonic_time(microsecond),
    S#s{out = convoy_remote:send(ReplyTo, {Tag, convoy_meter, Time}, S#s.out)};
act({piece_reply, Ref, What}, S) ->
    S#s{out = convoy_remote:send(Ref, {Ref, convoy_piece, What}, S#s.out)};
act({demonitor, Watch}, S) ->
    ok = convoy_remote:unwatch(Watch),
    S;
act({release, Node, Held}, S) ->
    ok = convoy_chunk_bound:release(S#s.slot, Node, Held),
    S;
act({forget, Node}, S) ->
    ok = convoy_chunk_bound:forget(Node),
    S;
act({received, C, N}, S) ->
    convoy_metrics:add(C, received, N),
    S;
act({rejected, Kind}, S = #s{from = none}) ->
    convoy_metrics:rejected(Kind),
    S;
act({rejected, Kind}, S = #s{from = From}) ->
    convoy_metrics:rejected(Kind, #{from => From}),
    S.

%% Like `!' to a remote name: a name nobody holds drops the message (counted).
send(To, Msg) when is_atom(To) ->
    try
        erlang:send(To, Msg)
    catch
        error:badarg -> convoy_metrics:rejected(undeliverable)
    end;
send(To, Msg) ->
    erlang:send(To, Msg).

%% pg's local members are pids of this node's incarnation; anything else (a table
%% that is not pg's after all) is skipped. Each member gets the messages back to
%% back. Members come from convoy_wire:take_members/3, which ends an improper
%% list where it stops.
publish(Members, [Msg], Local) ->
    publish_one(Members, Msg, Local);
publish([], _Msgs, _Local) -> ok;
publish([P | Ps], Msgs, Local) when is_pid(P), node(P) =:= Local ->
    send_all(P, Msgs),
    publish(Ps, Msgs, Local);
publish([_ | Ps], Msgs, Local) -> publish(Ps, Msgs, Local).

%% One message (a publish entry alone, the usual case).
publish_one([P | Ps], Msg, Local) when is_pid(P), node(P) =:= Local ->
    P ! Msg,
    publish_one(Ps, Msg, Local);
publish_one([_ | Ps], Msg, Local) -> publish_one(Ps, Msg, Local);
publish_one([], _Msg, _Local) -> ok.

undeliverable(0) -> ok;
undeliverable(N) -> convoy_metrics:rejected(undeliverable), undeliverable(N - 1).

send_each([], _Msg) -> ok;
send_each([To | Tos], Msg) -> send(To, Msg), send_each(Tos, Msg).

send_all(_P, []) -> ok;
send_all(P, [Msg | Msgs]) -> P ! Msg, send_all(P, Msgs).

%% The settings in force (the defaults while convoy's runtime is not published).
max_reassembly_bytes() ->
    case persistent_term:get(?RUNTIME_KEY, undefined) of
        #runtime{max_reassembly_bytes = B} -> B;
        undefined -> maps:get(max_reassembly_bytes, convoy_config:defaults())
    end.

barrier_timeout() ->
    case persistent_term:get(?RUNTIME_KEY, undefined) of
        #runtime{barrier_timeout = T} -> T;
        undefined -> maps:get(barrier_timeout, convoy_config:defaults())
    end.

-spec system_continue(pid(), [sys:debug_option()], #s{}) -> no_return().
system_continue(_Parent, _Debug, S) -> loop(S).

-spec system_terminate(term(), pid(), [sys:debug_option()], #s{}) -> no_return().
system_terminate(Reason, _Parent, _Debug, _S) -> exit(Reason).

-spec system_get_state(#s{}) -> {ok, map()}.
system_get_state(S) -> {ok, convoy_inbox_core:summary(S#s.core)}.

-spec system_code_change(#s{}, module(), term(), term()) -> {ok, #s{}}.
system_code_change(S, _Module, _OldVsn, _Extra) -> {ok, S}.
