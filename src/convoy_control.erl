%% @private
%% Owns the settings in force and the lanes: publishes the settings in
%% persistent_term, and beside them each node's runtime (`convoy_lanes': the
%% settings with the node's own lanes); applies `convoy:set_config/1', starts a
%% node's lanes when it connects (or a message goes to it first), retires them
%% once `convoy_peers' forgot the node, replaces lanes when `lanes' changes,
%% replaces a lane that dies, and drains the lanes when convoy stops.
%%
%% A node forgotten is gone (no row, not connected): its lanes retire as in a
%% lane change, with no successors. If it is sent to again before they are gone,
%% its new lanes start held for it and are released once they are.
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
%% and logged, and a new lane with new counters takes its index among its node's,
%% so it ships to the same inbox of the node, behind whatever the dead lane had
%% shipped. Nothing else restarts.
%%
%% Stopping (terminate/2) closes every lane and publishes the runtime marked
%% `stopping'; the lanes retire as in a lane change, with no successors. Senders
%% with messages in a lane wait for it to finish before sending plainly (see
%% convoy_send), so order holds across the switch to plain sends. Bounded by
%% `?STOP_MS'; a lane still there then (waiting on a stalled peer's connection)
%% is killed, and what it held is counted as dropped for its node and logged.
%%
%% Messages between this process and the lanes carry a secret reference, so a
%% stray copy cannot act on either side; a `DOWN' is acted on only for a monitor
%% this process holds.
-module(convoy_control).
-behaviour(gen_server).

-export([start_link/1, set_config/1, lanes_for/1, lane_nodes/0, status/0]).
-export([init/1, handle_call/3, handle_cast/2, handle_info/2, terminate/2]).

-include("convoy_runtime.hrl").
-include("convoy_tags.hrl").
-include_lib("kernel/include/logger.hrl").

%% The longest a stop waits for the lanes to drain; the child spec's shutdown in
%% convoy_sup leaves room above it.
-define(STOP_MS, 10000).

-record(switch, {old :: #{node() => #runtime{}},
                 %% the new lanes (not those of nodes added since)
                 new :: [pid()],
                 %% old lanes not yet retired
                 retiring :: [pid()],
                 reported = [] :: [pid()],
                 pending = #{} :: #{node() => [pid()]},
                 %% whether the new lanes were told which nodes they hold
                 hold_sent = false :: boolean()}).

-record(s, {config :: convoy_config:config(),
            runtime :: #runtime{} | undefined, % undefined only while starting
            secret :: reference(),
            %% each node's runtime: the settings, and the node's own lanes
            rows = #{} :: #{node() => #runtime{}},
            monitors = #{} :: #{reference() => pid()},
            switch = none :: none | #switch{},
            %% lanes of forgotten nodes, retiring: their node and counters
            gone = #{} :: #{pid() => {node(), convoy_slots:slots()}},
            %% nodes forgotten during a lane change, retired once it ends
            forget = [] :: [node()]}).

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

%% @doc `Node''s lanes started, if it has none: once this returns its runtime is
%% published (unless convoy stopped meanwhile).
-spec lanes_for(node()) -> ok.
lanes_for(Node) ->
    try
        gen_server:call(?MODULE, {lanes_for, Node}, infinity)
    catch
        exit:_ -> ok % not running, or stopping meanwhile: the caller reads that
    end.

%% @doc The nodes with lanes (none when convoy is not running).
-spec lane_nodes() -> [node()].
lane_nodes() ->
    try gen_server:call(?MODULE, nodes, infinity) catch exit:_ -> [] end.

%% @doc The settings in force and the lanes (`convoy:info/0'), or `not_running'.
-spec status() -> not_running
                | #{settings := convoy_config:config(),
                    lanes := [#{node := node(), index := pos_integer(), pid := pid(),
                                queue := non_neg_integer()}]}.
status() ->
    try gen_server:call(?MODULE, lanes, infinity) of
        {Config, Lanes} ->
            #{settings => Config,
              lanes => [L#{queue => queue_len(P)} || L = #{pid := P} <- Lanes]}
    catch
        exit:_ -> not_running
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
    ok = net_kernel:monitor_nodes(true),
    RT = runtime(Config, N, erlang:unique_integer([positive])),
    ok = convoy_runtimes:erase_nodes(all), % a previous start's, if it ended without its stop
    S = lists:foldl(fun start_node/2, #s{config = Config, secret = make_ref(), runtime = RT},
                    lists:sort(nodes())),
    {ok, publish(S)}.

%% A node's runtime, `RT' with the node's own `n' lanes (started with it, `Held'
%% as a lane change's are, `none' otherwise) and their admission counters.
start_row(RT = #runtime{n = N, clock = Clock}, Held, S) ->
    Behind = behind(Held),
    Row = RT#runtime{slots = list_to_tuple([convoy_slots:new(Behind, Clock)
                                            || _ <- lists:seq(1, N)])},
    {Pids, S1} = lists:mapfoldl(fun(I, Acc) -> start_lane(I, Held, Row, Acc) end, S,
                                lists:seq(1, N)),
    {Row#runtime{lanes = list_to_tuple(Pids)}, S1}.

%% What senders read (`convoy_runtimes').
publish(S = #s{runtime = RT, rows = Rows}) ->
    ok = convoy_runtimes:publish(RT, Rows),
    S.

publish_node(Node, S = #s{runtime = RT, rows = Rows}) ->
    ok = convoy_runtimes:publish_node(Node, RT, Rows),
    S.

%% A node gets its lanes when it connects, or when a message goes to it first
%% (a hidden node, or one not connected yet). While the lanes it had before it
%% was forgotten still retire, its new ones hold its traffic until they are gone
%% (`gone_done/2'); otherwise no lane has had traffic for it, and they hold
%% nothing back.
add_node(Node, S = #s{rows = Rows}) when is_map_key(Node, Rows) ->
    S;
add_node(Node, S) ->
    publish_node(Node, start_node(Node, S)).

start_node(Node, S = #s{rows = Rows}) when is_map_key(Node, Rows) ->
    S;
start_node(Node, S = #s{rows = Rows, runtime = RT}) ->
    {Row, S1} = start_row(RT, node_held(Node, S), S),
    S1#s{rows = Rows#{Node => Row}}.

node_held(Node, #s{gone = Gone}) ->
    case lists:keymember(Node, 1, maps:values(Gone)) of
        true -> [Node];
        false -> none
    end.

start_lane(I, Held, RT, S = #s{secret = Secret, monitors = M}) ->
    {ok, Pid} = convoy_lane_sup:start_lane(I, Held, RT, {self(), Secret}),
    {Pid, S#s{monitors = M#{erlang:monitor(process, Pid) => Pid}}}.

%% The runtime for Config: every field named after a setting takes that setting's
%% value, so a new setting needs only its field in convoy_runtime.hrl (`lanes' is
%% the exception: the count is `n', the field holds a node's lane pids). The other
%% fields are set here; a field that is neither fails at start-up with
%% `{badkey, Field}'. Built as a tuple because a `#runtime{}' literal would have
%% to name each setting again.
runtime(Config, N, Generation) ->
    Values = maps:merge(maps:remove(lanes, Config),
                        #{lanes => {}, rows => #{}, slots => {}, clock => convoy_slots:clock(),
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
            #runtime{generation = Gen, n = N} = S#s.runtime,
            RT = runtime(New, N, Gen),
            Rows = maps:map(fun(_Node, #runtime{lanes = Lanes, slots = Slots}) ->
                                    RT#runtime{lanes = Lanes, slots = Slots}
                            end, S#s.rows),
            {reply, ok, publish(S#s{config = New, runtime = RT, rows = Rows})};
        {ok, _New} when S#s.switch =/= none ->
            {reply, {error, {busy, lanes}}, S};
        {ok, New} ->
            {reply, ok, switch_lanes(New, S)}
    end;
handle_call({lanes_for, Node}, _From, S) when is_atom(Node) ->
    {reply, ok, add_node(Node, S)};
handle_call(nodes, _From, S) ->
    {reply, lists:sort(maps:keys(S#s.rows)), S};
handle_call(lanes, _From, S = #s{config = Config}) ->
    {reply, {Config, [#{node => Node, index => I, pid => element(I, Lanes)}
                      || {Node, #runtime{lanes = Lanes}} <- lists:sort(maps:to_list(S#s.rows)),
                         I <- lists:seq(1, tuple_size(Lanes))]}, S};
handle_call(_Req, _From, S) ->
    convoy_metrics:rejected(unknown_message),
    {reply, {error, unknown_call}, S}.

%% @private
-spec handle_cast(term(), #s{}) -> {noreply, #s{}}.
handle_cast(_Msg, S) ->
    convoy_metrics:rejected(unknown_message),
    {noreply, S}.

switch_lanes(New = #{lanes := M}, S0 = #s{runtime = OldRT, rows = OldRows}) ->
    RT = runtime(New, M, OldRT#runtime.generation),
    {Rows, S1} = maps:fold(fun(Node, _Old, {Acc, SAcc}) ->
                                   {Row, SAcc1} = start_row(RT, all, SAcc),
                                   {Acc#{Node => Row}, SAcc1}
                           end, {#{}, S0}, OldRows),
    S2 = publish(S1#s{runtime = RT, rows = Rows}),
    Old = retire_all(OldRows, S2),
    S2#s{config = New, switch = #switch{old = OldRows, new = row_lanes(Rows), retiring = Old}}.

row_lanes(Rows) ->
    [P || #runtime{lanes = Lanes} <- maps:values(Rows), P <- tuple_to_list(Lanes)].

%% Close every lane of these rows and tell it to retire; returns the lanes.
retire_all(Rows, S) ->
    lists:append([retire_row(Row, S) || Row <- maps:values(Rows)]).

retire_row(#runtime{lanes = Lanes, slots = Slots}, #s{secret = Secret, gone = Gone}) ->
    [begin
         K = convoy_slots:close(element(I, Slots)),
         Pid ! {?TAG_RETIRE, Secret, K},
         Pid
     end || I <- lists:seq(1, tuple_size(Lanes)), Pid <- [element(I, Lanes)],
            not is_map_key(Pid, Gone)].

%% @private
-spec handle_info(term(), #s{}) -> {noreply, #s{}}.
handle_info({?TAG_RETIRING, Secret, Pid, _Nodes}, S = #s{secret = Secret, gone = Gone})
  when is_map_key(Pid, Gone) ->
    {noreply, S}; % a forgotten node's: nothing waits for its barriers
handle_info({?TAG_NODE_DONE, Secret, Pid, _Node}, S = #s{secret = Secret, gone = Gone})
  when is_map_key(Pid, Gone) ->
    {noreply, S};
handle_info({?TAG_RETIRED, Secret, Pid}, S = #s{secret = Secret, gone = Gone})
  when is_map_key(Pid, Gone) ->
    {noreply, gone_done(Pid, S)};
handle_info({?TAG_FORGOTTEN, Node}, S) when is_atom(Node) ->
    {noreply, forget_node(Node, S)};
handle_info({nodeup, Node}, S) ->
    {noreply, publish(start_node(Node, S))};
handle_info({nodedown, _Node}, S) ->
    {noreply, publish(S)};
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
            lists:foldl(fun forget_node/2, S#s{switch = none, forget = []}, S#s.forget);
        Rest ->
            S#s{switch = Sw#switch{retiring = Rest,
                                   reported = lists:delete(Pid, Sw#switch.reported)}}
    end.

to_new_lanes(#s{switch = #switch{new = New}}, Msg) ->
    _ = [Pid ! Msg || Pid <- New],
    ok.

%%--------------------------------------------------------------------
%% A node forgotten

%% convoy_peers forgot `Node' (its `TAG_FORGOTTEN' message): if it is really gone
%% (no row, not connected), its lanes retire as in a lane change, nothing held
%% back behind them (a row is forgotten only once nothing is held for its node),
%% and its runtime goes: a message to it afterwards starts new lanes.
forget_node(Node, S = #s{switch = #switch{}}) ->
    S#s{forget = [Node | lists:delete(Node, S#s.forget)]};
forget_node(Node, S = #s{rows = Rows}) ->
    case Rows of
        #{Node := Row = #runtime{lanes = Lanes, slots = Slots}} ->
            case convoy_peers:lookup(Node) =:= none
                andalso not lists:member(Node, nodes(connected)) of
                true ->
                    S1 = S#s{rows = maps:remove(Node, Rows)},
                    ok = convoy_runtimes:unpublish_node(Node, S1#s.runtime, S1#s.rows),
                    _ = retire_row(Row, S1),
                    Gone = maps:from_list([{element(I, Lanes), {Node, element(I, Slots)}}
                                           || I <- lists:seq(1, tuple_size(Lanes))]),
                    S1#s{gone = maps:merge(S1#s.gone, Gone)};
                false ->
                    S
            end;
        _ ->
            S
    end.

%% A forgotten node's lane retired (or died): once the last of them is gone, a
%% new row of the node's, held meanwhile, is released.
gone_done(Pid, S = #s{gone = Gone0}) ->
    {Node, _Slots} = maps:get(Pid, Gone0),
    S1 = S#s{gone = maps:remove(Pid, Gone0)},
    case {node_held(Node, S1), S1#s.rows} of
        {none, #{Node := #runtime{lanes = Lanes}}} ->
            _ = [P ! {?TAG_RELEASE, S#s.secret, Node} || P <- tuple_to_list(Lanes)],
            S1;
        _ ->
            S1
    end.

%%--------------------------------------------------------------------
%% A lane died

lane_died(Pid, Reason, S) ->
    case locate(Pid, S) of
        {gone, Node, Slots} ->
            %% what a forgotten node's lane still held is lost
            count_lost(Slots, 0, {Node, retiring}, Reason),
            gone_done(Pid, S);
        {row, Node, I, _Slots} ->
            replace_lane(Node, I, Reason, S);
        {old, Node, Slots} ->
            count_lost(Slots, 0, {Node, retiring}, Reason),
            old_lane_died(Pid, S);
        none when S#s.switch =/= none ->
            old_lane_died(Pid, S);
        none ->
            S
    end.

%% An old lane of a lane change died (what it held is counted lost): the change
%% goes on without it.
old_lane_died(Pid, S = #s{switch = Sw}) ->
    S1 = lists:foldl(fun(Node, Acc) -> node_done(Pid, Node, Acc) end,
                     S#s{switch = Sw#switch{reported = [Pid | lists:delete(Pid, Sw#switch.reported)]}},
                     maps:keys(Sw#switch.pending)),
    retired(Pid, maybe_hold(S1)).

%% Where a lane is, with its node and admission counters: a forgotten node's
%% (`gone'), lane I of a node's (`row'), or an old one of a lane change (`old').
locate(Pid, #s{gone = Gone}) when is_map_key(Pid, Gone) ->
    {Node, Slots} = maps:get(Pid, Gone),
    {gone, Node, Slots};
locate(Pid, #s{rows = Rows, switch = Sw}) ->
    case {find_lane(Pid, Rows), Sw} of
        {{Node, I}, _} ->
            {row, Node, I, element(I, (maps:get(Node, Rows))#runtime.slots)};
        {none, #switch{old = Old}} ->
            case find_lane(Pid, Old) of
                {Node, I} -> {old, Node, element(I, (maps:get(Node, Old))#runtime.slots)};
                none -> none
            end;
        {none, none} ->
            none
    end.

%% A new lane at the dead one's place among its node's, with new counters: the
%% dead lane's are closed (senders that land there read the runtime again).
replace_lane(Node, I, Reason, S = #s{rows = Rows, switch = Sw}) ->
    Row = #runtime{lanes = Lanes, slots = Slots} = maps:get(Node, Rows),
    Dead = element(I, Lanes),
    New = is_new(Dead, S),
    Held = lane_held(Node, New, S),
    Behind = behind(Held),
    count_lost(element(I, Slots), Behind, {Node, I}, Reason),
    Row1 = Row#runtime{slots = setelement(I, Slots, convoy_slots:new(Behind, Row#runtime.clock))},
    {Pid, S1} = start_lane(I, Held, Row1, S),
    Row2 = Row1#runtime{lanes = setelement(I, Lanes, Pid)},
    Sw1 = case Sw of
              #switch{new = N1} when New -> Sw#switch{new = [Pid | lists:delete(Dead, N1)]};
              _ -> Sw
          end,
    publish_node(Node, S1#s{rows = Rows#{Node := Row2}, switch = Sw1}).

%% Whether a lane is one of a lane change's new ones.
is_new(Pid, #s{switch = #switch{new = New}}) -> lists:member(Pid, New);
is_new(_Pid, #s{switch = none}) -> false.

%% What a lane of Node's holds back now: a new lane of a lane change what the
%% change still holds, another what its node's forgotten lanes still do.
lane_held(_Node, true, #s{switch = #switch{hold_sent = false}}) -> all;
lane_held(_Node, true, #s{switch = #switch{pending = P}}) when map_size(P) > 0 -> maps:keys(P);
lane_held(_Node, true, _S) -> none; % every node released
lane_held(Node, false, S) -> node_held(Node, S).

%% A held lane's counters start one behind (it opens with a disposal of one).
behind(none) -> 0;
behind(_Held) -> 1.

%% Behind: 1 if the lane was still held (its counters started one behind).
%% Which: `{Node, I}', a lane replaced, or `{Node, retiring}', one that was going.
count_lost(Slots, Behind, {Node, Which}, Reason) ->
    Lost = unsettled(Slots, Behind),
    convoy_metrics:lost(Lost),
    ?LOG_ERROR(#{what => convoy_lane_died, node => Node, lane => Which, reason => Reason,
                 lost => Lost,
                 note => case Which of
                             retiring -> "the lane was retiring; nothing restarts";
                             _ -> "the lane is replaced; nothing else restarts"
                         end}).

find_lane(Pid, Rows) ->
    case [{Node, I} || {Node, #runtime{lanes = Lanes}} <- maps:to_list(Rows),
                       I <- lists:seq(1, tuple_size(Lanes)), element(I, Lanes) =:= Pid] of
        [Found | _] -> Found;
        [] -> none
    end.

%%--------------------------------------------------------------------
%% Stop

%% @private
-spec terminate(term(), #s{}) -> ok.
terminate(Reason, S0) ->
    Deadline = erlang:monotonic_time(millisecond) + ?STOP_MS,
    S = await_switch(S0, Deadline),
    RT = S#s.runtime,
    _ = publish(S#s{runtime = RT#runtime{stopping = true},
                    rows = maps:map(fun(_, Row) -> Row#runtime{stopping = true} end, S#s.rows)}),
    Lanes = retire_all(S#s.rows, S) ++ maps:keys(S#s.gone),
    stop_lanes(await_lanes(Lanes, S, Deadline), S),
    log_stop(Reason),
    convoy_runtimes:erase(RT#runtime.generation).

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

%% Returns the lanes still there at the deadline.
await_lanes([], _S, _Deadline) ->
    [];
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
                       note => "they are killed; what they held is counted as dropped"}),
        Lanes
    end.

%% Lanes still there at the stop's limit wait on their node's connection (a
%% stalled peer), where they cannot read their mailboxes: killed, what each was
%% admitted for and did not dispose of is counted as dropped for its node, and
%% logged.
stop_lanes(Lanes, S = #s{monitors = M}) ->
    Dropped = lists:foldl(
                fun(Pid, Acc) ->
                        true = exit(Pid, kill),
                        _ = [receive {'DOWN', Ref, process, Pid, _} -> ok end
                             || {Ref, P} <- maps:to_list(M), P =:= Pid],
                        case locate(Pid, S) of
                            {row, Node, _I, Slots} ->
                                Behind = behind(lane_held(Node, is_new(Pid, S), S)),
                                add_dropped(Node, unsettled(Slots, Behind), Acc);
                            {_GoneOrOld, Node, Slots} ->
                                add_dropped(Node, unsettled(Slots, 0), Acc);
                            none ->
                                Acc
                        end
                end, #{}, Lanes),
    maps:foreach(fun count_dropped/2, maps:filter(fun(_, N) -> N > 0 end, Dropped)).

%% What the node's killed lanes never read from their mailboxes was not counted
%% accepted: it is now, beside what they had accepted and not disposed of, so
%% that accepted = messages + dropped holds.
count_dropped(Node, Dropped) ->
    _ = case convoy_peers:refs(Node) of
            {C, _Held} ->
                #{accepted := A, messages := Sent, dropped := D} = convoy_metrics:node_info(C),
                convoy_metrics:add(C, accepted, max(0, Dropped - (A - Sent - D))),
                convoy_metrics:add(C, dropped, Dropped);
            undefined ->
                ok
        end,
    ?LOG_WARNING(#{what => convoy_lane_stopped, node => Node, reason => killed_waiting,
                   dropped => #{Node => Dropped}}).

add_dropped(Node, K, Acc) ->
    maps:update_with(Node, fun(N) -> N + K end, K, Acc).

%% What a lane was admitted for and has not disposed of (its counters closed;
%% `Behind': 1 if it was still held, its counters having started one behind).
unsettled(Slots, Behind) ->
    max(0, convoy_slots:close(Slots) - convoy_slots:disposed(Slots) - Behind).

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
