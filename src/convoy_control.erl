%% @private
%% Owns the settings in force: publishes them (with the lane table) in
%% persistent_term, applies `convoy:set_config/1', replaces lanes when `lanes'
%% changes, replaces a lane that dies, and drains the lanes when convoy stops.
%%
%% Changing `lanes' loses and reorders nothing:
%% <ol>
%% <li>the new lanes start "held": they take messages but ship none, and their
%%   admission counters start one behind, so no sender sees them idle;</li>
%% <li>the new runtime is published, then each old lane is closed
%%   (`convoy_slots:close/1'): the number returned is exactly how many admissions
%%   that lane granted; a sender that lands above it re-reads the runtime;</li>
%% <li>each old lane ships everything it was given, waits until all its admissions
%%   (including senders' own direct sends) are disposed of, reports the convoy peers
%%   it must confirm, and sends a barrier to each one's inbox;</li>
%% <li>a node is released in the new lanes once every old lane has confirmed it, so
%%   nothing a sender gives a new lane can overtake what it gave an old one.</li>
%% </ol>
%% A stalled node delays only its own release. Other settings apply at the lanes'
%% next cycle. The number of inboxes is fixed when convoy starts.
%%
%% A lane that dies (killed from outside, or a bug) is replaced in place: its
%% counters are closed, what it held is counted as lost (`convoy_metrics:lost/1')
%% and logged, and a new lane with new counters takes its index, so it ships to the
%% same inbox of each peer, behind whatever the dead lane had shipped. Nothing else
%% restarts.
%%
%% Stopping (terminate/2) closes every lane and publishes the runtime marked
%% `stopping'; the lanes retire as in a lane change, with no successors. Senders
%% with messages in a lane wait for it to finish before sending plainly (see
%% convoy_send), so order holds across the switch to plain sends. Bounded by
%% `?STOP_MS'; a lane still busy then is shut down by its supervisor, and counts
%% and logs what it could not ship.
%%
%% Messages between this process and the lanes carry a secret reference, so a
%% stray copy cannot act on either side; a `DOWN' is acted on only for a monitor
%% this process holds.
-module(convoy_control).
-behaviour(gen_server).

-export([start_link/1, set_config/1, flush/2, status/0]).
-export([init/1, handle_call/3, handle_cast/2, handle_info/2, terminate/2]).

-include("convoy_runtime.hrl").
-include("convoy_tags.hrl").
-include_lib("kernel/include/logger.hrl").

%% The longest a stop waits for the lanes to drain; the child spec's shutdown in
%% convoy_sup leaves room above it.
-define(STOP_MS, 10000).

-record(switch, {old :: #runtime{},
                 %% old lanes not yet retired
                 retiring :: [pid()],
                 reported = [] :: [pid()],
                 pending = #{} :: #{node() => [pid()]},
                 %% whether the new lanes were told which nodes they hold
                 hold_sent = false :: boolean()}).

-record(s, {config :: convoy_config:config(),
            runtime :: #runtime{} | undefined, % undefined only while starting
            secret :: reference(),
            monitors = #{} :: #{reference() => pid()},
            switch = none :: none | #switch{}}).

-spec start_link(convoy_config:config()) -> {ok, pid()} | {error, term()}.
start_link(Config) ->
    gen_server:start_link({local, ?MODULE}, ?MODULE, Config, []).

-spec set_config(map()) -> ok | {error, convoy_config:error() | {busy, lanes} | not_started}.
set_config(Opts) ->
    try
        gen_server:call(?MODULE, {set_config, Opts}, infinity)
    catch
        exit:_ -> {error, not_started} % not running, or stopping meanwhile
    end.

%% @doc `convoy:flush/2', in the caller: wait until the caller's lane has shipped
%% or counted as dropped everything the caller handed it for `Which' (a node, or
%% `all'). With convoy stopping, wait for the lane to finish instead (bounded by
%% the stop); with convoy not running, or for this node, nothing waits.
-spec flush(node() | all, timeout()) -> ok | {error, timeout}.
flush(Which, Timeout) ->
    case persistent_term:get(?RUNTIME_KEY, undefined) of
        undefined ->
            ok;
        _ when Which =:= node() ->
            ok;
        RT = #runtime{stopping = true} ->
            %% The lane ships everything and goes (terminate/2 bounds the wait).
            convoy_wait:await_gone(element(convoy_send:lane_of(RT), RT#runtime.lanes));
        RT ->
            case convoy_wait:flush(element(convoy_send:lane_of(RT), RT#runtime.lanes), Which,
                                   Timeout) of
                ok -> ok;
                %% The lane was replaced (lanes changed) or convoy restarted.
                down -> flush(Which, Timeout);
                timeout -> {error, timeout}
            end
    end.

%% @doc The settings in force and the lanes (`convoy:info/0'), or `not_running'.
-spec status() -> not_running
                | #{settings := convoy_config:config(),
                    lanes := [#{index := pos_integer(), pid := pid(),
                                queue := non_neg_integer()}]}.
status() ->
    case persistent_term:get(?RUNTIME_KEY, undefined) of
        undefined ->
            not_running;
        #runtime{config = Config, n = N, lanes = Lanes} ->
            #{settings => Config,
              lanes => [#{index => I, pid => P, queue => queue_len(P)}
                        || {I, P} <- lists:zip(lists:seq(1, N), tuple_to_list(Lanes))]}
    end.

queue_len(Pid) ->
    case erlang:process_info(Pid, message_queue_len) of
        {message_queue_len, N} -> N;
        undefined -> 0
    end.

%% @private
-spec init(convoy_config:config()) -> {ok, #s{}}.
init(Config = #{lanes := N}) ->
    process_flag(trap_exit, true),
    S0 = #s{config = Config, secret = make_ref()},
    {RT, S1} = start_lanes(runtime(Config, N, erlang:unique_integer([positive])), none, S0),
    persistent_term:put(?RUNTIME_KEY, RT),
    {ok, S1#s{runtime = RT}}.

%% Lanes start with the runtime they will serve (all of it but the lane table).
start_lanes(RT = #runtime{n = N}, Held, S) ->
    Behind = case Held of none -> 0; _ -> 1 end,
    RT1 = RT#runtime{slots = list_to_tuple([convoy_slots:new(Behind, RT#runtime.clock)
                                            || _ <- lists:seq(1, N)])},
    {Pids, S1} = lists:mapfoldl(fun(I, Acc) -> start_lane(I, Held, RT1, Acc) end, S,
                                lists:seq(1, N)),
    {RT1#runtime{lanes = list_to_tuple(Pids)}, S1}.

start_lane(I, Held, RT, S = #s{secret = Secret, monitors = M}) ->
    {ok, Pid} = convoy_lane_sup:start_lane(I, Held, RT, {self(), Secret}),
    {Pid, S#s{monitors = M#{erlang:monitor(process, Pid) => Pid}}}.

%% The runtime for Config: every field named after a setting takes that setting's
%% value, so a new setting needs only its field in convoy_runtime.hrl (`lanes' is
%% the exception: the count is `n', the field holds the lane pids). The other
%% fields are set here; a field that is neither fails at start-up with
%% `{badkey, Field}'. Built as a tuple because a `#runtime{}' literal would have
%% to name each setting again.
runtime(Config, N, Generation) ->
    Values = maps:merge(maps:remove(lanes, Config),
                        #{lanes => {}, slots => {}, clock => convoy_slots:clock(),
                          generation => Generation, n => N,
                          stopping => false, refuse => drop, config => Config}),
    list_to_tuple([runtime | [maps:get(F, Values) || F <- record_info(fields, runtime)]]).

%% @private
-spec handle_call(term(), gen_server:from(), #s{}) -> {reply, term(), #s{}}.
handle_call({set_config, Opts}, _From, S = #s{config = Old}) ->
    case convoy_config:merge(Old, Opts) of
        {error, _} = E ->
            {reply, E, S};
        {ok, New} when map_get(lanes, New) =:= map_get(lanes, Old) ->
            #runtime{generation = Gen, lanes = Lanes, slots = Slots, n = N} = S#s.runtime,
            RT = (runtime(New, N, Gen))#runtime{lanes = Lanes, slots = Slots},
            persistent_term:put(?RUNTIME_KEY, RT),
            {reply, ok, S#s{config = New, runtime = RT}};
        {ok, _New} when S#s.switch =/= none ->
            {reply, {error, {busy, lanes}}, S};
        {ok, New} ->
            {reply, ok, switch_lanes(New, S)}
    end;
handle_call(_Req, _From, S) ->
    convoy_metrics:rejected(unknown_message),
    {reply, {error, unknown_call}, S}.

%% @private
-spec handle_cast(term(), #s{}) -> {noreply, #s{}}.
handle_cast(_Msg, S) ->
    convoy_metrics:rejected(unknown_message),
    {noreply, S}.

switch_lanes(New = #{lanes := M}, S = #s{runtime = OldRT}) ->
    {RT, S1} = start_lanes(runtime(New, M, OldRT#runtime.generation), all, S),
    persistent_term:put(?RUNTIME_KEY, RT),
    Old = retire_all(OldRT, S1),
    S1#s{config = New, runtime = RT, switch = #switch{old = OldRT, retiring = Old}}.

%% Close every lane of a runtime and tell it to retire; returns the lanes.
retire_all(#runtime{lanes = Lanes, slots = Slots}, #s{secret = Secret}) ->
    [begin
         K = convoy_slots:close(element(I, Slots)),
         Pid ! {?TAG_RETIRE, Secret, K},
         Pid
     end || {I, Pid} <- lists:zip(lists:seq(1, tuple_size(Lanes)), tuple_to_list(Lanes))].

%% @private
-spec handle_info(term(), #s{}) -> {noreply, #s{}}.
handle_info({?TAG_RETIRING, Secret, Pid, Nodes}, S = #s{secret = Secret, switch = #switch{}})
  when is_list(Nodes) ->
    {noreply, retiring(Pid, Nodes, S)};
handle_info({?TAG_NODE_DONE, Secret, Pid, Node}, S = #s{secret = Secret, switch = #switch{}}) ->
    {noreply, node_done(Pid, Node, S)};
handle_info({?TAG_RETIRED, Secret, Pid}, S = #s{secret = Secret, switch = #switch{}}) ->
    {noreply, retired(Pid, S)};
handle_info({'DOWN', Ref, process, Pid, Reason}, S = #s{monitors = M}) when is_map_key(Ref, M) ->
    S1 = S#s{monitors = maps:remove(Ref, M)},
    case Reason of
        normal -> {noreply, S1}; % retired
        _ -> {noreply, lane_died(Pid, Reason, S1)}
    end;
handle_info({'EXIT', _Pid, _Reason}, S) ->
    {noreply, S};
handle_info(_Msg, S) ->
    %% Stray, forged or duplicated (a DOWN for a monitor not ours included).
    convoy_metrics:rejected(unknown_message),
    {noreply, S}.

%%--------------------------------------------------------------------
%% Lane change in progress

retiring(Pid, Nodes, S = #s{switch = Sw}) ->
    case lists:member(Pid, Sw#switch.retiring) andalso not lists:member(Pid, Sw#switch.reported) of
        true ->
            Pending = lists:foldl(fun(N, P) -> maps:update_with(N, fun(L) -> [Pid | L] end,
                                                                  [Pid], P)
                                  end, Sw#switch.pending, [N || N <- Nodes, is_atom(N)]),
            maybe_hold(S#s{switch = Sw#switch{reported = [Pid | Sw#switch.reported],
                                              pending = Pending}});
        false ->
            convoy_metrics:rejected(unknown_message),
            S
    end.

%% Once every old lane has reported, the new lanes learn which nodes they still
%% hold; the others are released at once.
maybe_hold(S = #s{switch = Sw = #switch{hold_sent = false}}) ->
    case length(Sw#switch.reported) =:= length(Sw#switch.retiring) of
        true ->
            to_new_lanes(S, {?TAG_HOLD, S#s.secret, maps:keys(Sw#switch.pending)}),
            S#s{switch = Sw#switch{hold_sent = true}};
        false ->
            S
    end;
maybe_hold(S) ->
    S.

node_done(Pid, Node, S = #s{switch = Sw = #switch{pending = P}}) ->
    case P of
        #{Node := Waiting} ->
            case lists:delete(Pid, Waiting) of
                [] -> release(Node, S#s{switch = Sw#switch{pending = maps:remove(Node, P)}});
                Left -> S#s{switch = Sw#switch{pending = P#{Node := Left}}}
            end;
        _ ->
            S
    end.

release(Node, S = #s{switch = #switch{hold_sent = true}}) ->
    to_new_lanes(S, {?TAG_RELEASE, S#s.secret, Node}),
    S;
release(_Node, S) ->
    S. % not held yet: the hold message will not name it

retired(Pid, S = #s{switch = Sw}) ->
    case lists:delete(Pid, Sw#switch.retiring) of
        [] ->
            S#s{switch = none};
        Rest ->
            S#s{switch = Sw#switch{retiring = Rest,
                                   reported = lists:delete(Pid, Sw#switch.reported)}}
    end.

to_new_lanes(#s{runtime = #runtime{lanes = Lanes}}, Msg) ->
    _ = [Pid ! Msg || Pid <- tuple_to_list(Lanes)],
    ok.

%%--------------------------------------------------------------------
%% A lane died

lane_died(Pid, Reason, S = #s{runtime = RT, switch = Sw}) ->
    case index_of(Pid, RT#runtime.lanes) of
        {ok, I} ->
            replace_lane(I, Reason, S);
        none when Sw =/= none ->
            %% An old lane of a lane change: what it held is lost; the change goes on
            %% without it.
            count_lost(Sw#switch.old, Pid, 0, Reason),
            S1 = lists:foldl(fun(Node, Acc) -> node_done(Pid, Node, Acc) end,
                             S#s{switch = Sw#switch{reported = [Pid | lists:delete(Pid, Sw#switch.reported)]}},
                             maps:keys(Sw#switch.pending)),
            retired(Pid, maybe_hold(S1));
        none ->
            S
    end.

%% A new lane at the dead one's index, with new counters: the dead lane's are closed
%% (senders that land there re-read the runtime).
replace_lane(I, Reason, S = #s{runtime = RT, switch = Sw}) ->
    {Held, Behind} = case Sw of
                         #switch{hold_sent = false} -> {all, 1};
                         #switch{pending = P} when map_size(P) > 0 -> {maps:keys(P), 1};
                         _ -> {none, 0} % no change in progress, or every node released
                     end,
    count_lost(RT, element(I, RT#runtime.lanes), Behind, Reason),
    Slots = convoy_slots:new(Behind, RT#runtime.clock),
    RT1 = RT#runtime{slots = setelement(I, RT#runtime.slots, Slots)},
    {Pid, S1} = start_lane(I, Held, RT1, S),
    RT2 = RT1#runtime{lanes = setelement(I, RT1#runtime.lanes, Pid)},
    persistent_term:put(?RUNTIME_KEY, RT2),
    S1#s{runtime = RT2}.

%% Behind: 1 if the lane was still held (its counters started one behind).
count_lost(RT = #runtime{lanes = Lanes}, Pid, Behind, Reason) ->
    {ok, I} = index_of(Pid, Lanes),
    Slots = element(I, RT#runtime.slots),
    Granted = convoy_slots:close(Slots),
    Lost = max(0, Granted - convoy_slots:disposed(Slots) - Behind),
    convoy_metrics:lost(Lost),
    ?LOG_ERROR(#{what => convoy_lane_died, lane => I, reason => Reason, lost => Lost,
                 note => "the lane is replaced; nothing else restarts"}).

index_of(Pid, Lanes) ->
    index_of(Pid, Lanes, 1).

index_of(_Pid, Lanes, I) when I > tuple_size(Lanes) -> none;
index_of(Pid, Lanes, I) when element(I, Lanes) =:= Pid -> {ok, I};
index_of(Pid, Lanes, I) -> index_of(Pid, Lanes, I + 1).

%%--------------------------------------------------------------------
%% Stop

%% @private
-spec terminate(term(), #s{}) -> ok.
terminate(Reason, S0) ->
    Deadline = erlang:monotonic_time(millisecond) + ?STOP_MS,
    S = await_switch(S0, Deadline),
    RT = S#s.runtime,
    persistent_term:put(?RUNTIME_KEY, RT#runtime{stopping = true}),
    Lanes = retire_all(RT, S),
    await_lanes(Lanes, S, Deadline),
    log_stop(Reason),
    case persistent_term:get(?RUNTIME_KEY, undefined) of
        #runtime{generation = Gen} when Gen =:= RT#runtime.generation ->
            _ = persistent_term:erase(?RUNTIME_KEY),
            ok;
        _ ->
            ok % a later start of convoy published its own
    end.

%% A lane change in progress finishes first, so that the new lanes are released
%% and every message ships in order before they retire.
await_switch(S = #s{switch = none}, _Deadline) ->
    S;
await_switch(S, Deadline) ->
    receive
        Msg -> await_switch(element(2, handle_info(Msg, S)), Deadline)
    after max(0, Deadline - erlang:monotonic_time(millisecond)) ->
        S
    end.

await_lanes([], _S, _Deadline) ->
    ok;
await_lanes(Lanes, S = #s{secret = Secret, monitors = M}, Deadline) ->
    receive
        {?TAG_RETIRED, Secret, Pid} ->
            await_lanes(lists:delete(Pid, Lanes), S, Deadline);
        {'DOWN', Ref, process, Pid, _} when is_map_key(Ref, M) ->
            await_lanes(lists:delete(Pid, Lanes), S, Deadline);
        {?TAG_RETIRING, Secret, _, _} ->
            await_lanes(Lanes, S, Deadline);
        {?TAG_NODE_DONE, Secret, _, _} ->
            await_lanes(Lanes, S, Deadline)
    after max(0, Deadline - erlang:monotonic_time(millisecond)) ->
        ?LOG_WARNING(#{what => convoy_stop_timeout, lanes_still_draining => length(Lanes),
                       note => "their supervisor shuts them down; they count what is left"})
    end.

%% The counters go with convoy: say what they held.
log_stop(Reason) ->
    Nodes = try
                maps:from_list([{N, convoy_metrics:node_report(R, C, H)}
                                || {N, {R, C, H}} <- convoy_peers:all()])
            catch
                _:_ -> #{} % the node table went with convoy_peers
            end,
    Dropped = maps:fold(fun(_, #{dropped := D}, Acc) -> Acc + D end, 0, Nodes),
    Lost = try convoy_metrics:lost() catch _:_ -> 0 end,
    %% Lanes still draining at the stop's limit count what they drop after this:
    %% what is buffered then is reported too, so it is not hidden at info level.
    Buffered = maps:fold(fun(_, #{buffered := B}, Acc) -> Acc + B end, 0, Nodes),
    Level = case Dropped + Lost + Buffered of 0 -> info; _ -> notice end,
    ?LOG(Level, #{what => convoy_stopped, reason => Reason, dropped => Dropped, lost => Lost,
                  buffered => Buffered,
                  nodes => maps:map(fun(_, I) -> maps:with([accepted, messages, dropped,
                                                            buffered], I)
                                    end, Nodes)}).
