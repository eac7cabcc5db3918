%% @private
%% An inbound lane: registered as `convoy_inbox_I', it takes batches from peers'
%% lanes (see `convoy_wire') and delivers their entries, in order, with local sends.
%%
%% A connected node is trusted, but what reaches an inbox may be stray, duplicated,
%% misdirected or malformed: batches of unknown versions, from nodes that are not
%% connected, malformed entries, barriers for a third node and stray terms are
%% counted (see `convoy:info/0', `rejected') and the first of each kind is logged;
%% the valid entries of a batch are still delivered.
-module(convoy_inbox).

-export([start_link/1, init/2, system_continue/3, system_terminate/4,
         system_get_state/1, system_code_change/4]).

-record(s, {parent :: pid(),
            name :: atom(),
            local :: node(),
            peers = #{} :: #{node() => counters:counters_ref()}}).

-spec start_link(pos_integer()) -> {ok, pid()}.
start_link(Index) ->
    proc_lib:start_link(?MODULE, init, [self(), Index]).

-spec init(pid(), pos_integer()) -> no_return().
init(Parent, Index) ->
    Name = convoy_wire:inbox_name(Index),
    register(Name, self()),
    process_flag(message_queue_data, off_heap),
    process_flag(trap_exit, true),
    ok = net_kernel:monitor_nodes(true),
    proc_lib:init_ack(Parent, {ok, self()}),
    loop(#s{parent = Parent, name = Name, local = node()}).

loop(S) ->
    receive
        Msg -> loop(handle(Msg, S))
    end.

handle({nodedown, Node}, S) ->
    S#s{peers = maps:remove(Node, S#s.peers)};
handle({nodeup, _Node}, S) ->
    S;
handle({'EXIT', Parent, Reason}, #s{parent = Parent}) ->
    exit(Reason);
handle({system, From, Req}, S) ->
    sys:handle_system_msg(Req, From, S#s.parent, ?MODULE, [], S);
handle(Msg, S) ->
    case convoy_wire:decode(Msg) of
        {batch, _Vsn, From, Entries} ->
            case peer(From, S) of
                {ok, C, S1} ->
                    convoy_metrics:add(C, received, deliver(Entries, From, S#s.local, 0)),
                    S1;
                unknown ->
                    convoy_metrics:rejected(unknown_node),
                    S
            end;
        {error, Kind} ->
            convoy_metrics:rejected(Kind),
            S;
        {_HelloOrWelcome, _} ->
            convoy_metrics:rejected(unknown_message),
            S
    end.

%% A batch must come from a connected peer (it cannot come from anywhere else).
peer(Node, S = #s{peers = Peers}) ->
    case Peers of
        #{Node := C} ->
            {ok, C, S};
        _ ->
            case lists:member(Node, nodes(connected)) of
                true ->
                    C = convoy_metrics:node_counters(Node),
                    {ok, C, S#s{peers = Peers#{Node => C}}};
                false ->
                    unknown
            end
    end.

%% Returns the number of messages delivered; stops counting at an improper tail.
deliver([], _From, _Local, N) ->
    N;
deliver([E | Rest], From, Local, N) ->
    case convoy_wire:entry(E, From, Local) of
        {deliver, To, Msg} ->
            local_send(To, Msg),
            deliver(Rest, From, Local, N + 1);
        {multicast, Tos, Msg} ->
            _ = [local_send(To, Msg) || To <- Tos],
            deliver(Rest, From, Local, N + 1);
        {barrier, ReplyTo, Tag} ->
            _ = erlang:send(ReplyTo, {Tag, convoy_barrier}, [noconnect]),
            deliver(Rest, From, Local, N);
        {error, Kind} ->
            convoy_metrics:rejected(Kind),
            deliver(Rest, From, Local, N)
    end;
deliver(_ImproperTail, _From, _Local, N) ->
    convoy_metrics:rejected(malformed_batch),
    N.

%% Like `!' to a remote name: a name nobody holds drops the message (counted).
local_send(To, Msg) when is_atom(To) ->
    try
        erlang:send(To, Msg)
    catch
        error:badarg -> convoy_metrics:rejected(undeliverable)
    end;
local_send(To, Msg) ->
    erlang:send(To, Msg).

-spec system_continue(pid(), [sys:debug_option()], #s{}) -> no_return().
system_continue(_Parent, _Debug, S) -> loop(S).

-spec system_terminate(term(), pid(), [sys:debug_option()], #s{}) -> no_return().
system_terminate(Reason, _Parent, _Debug, _S) -> exit(Reason).

-spec system_get_state(#s{}) -> {ok, #s{}}.
system_get_state(S) -> {ok, S}.

-spec system_code_change(#s{}, module(), term(), term()) -> {ok, #s{}}.
system_code_change(S, _Module, _OldVsn, _Extra) -> {ok, S}.
