%% @private
%% Owns the settings in force: publishes them (with the lane table) in
%% persistent_term, applies `convoy:set_config/1', and replaces lanes when `lanes'
%% changes, without losing or reordering messages:
%% <ol>
%% <li>the new lanes start "held": they take messages but ship none, and their
%%   admission slots start one behind, so no sender sees them idle;</li>
%% <li>the new runtime is published, then each old lane's admission slot is closed
%%   (a jump of `CLOSED'): the number returned is exactly how many admissions that
%%   lane granted; a sender that lands above it re-reads the runtime;</li>
%% <li>each old lane ships everything it was given, waits until all its admissions
%%   (including senders' own direct sends) are disposed of, reports the convoy peers
%%   it must confirm, and sends a barrier to each one's inbox;</li>
%% <li>a node is released in the new lanes once every old lane has confirmed it, so
%%   nothing a sender gives a new lane can overtake what it gave an old one.</li>
%% </ol>
%% A stalled node delays only its own release. Other settings apply at the lanes'
%% next cycle. The number of inboxes is fixed when convoy starts.
-module(convoy_control).
-behaviour(gen_server).

-export([start_link/1, set_config/1]).
-export([init/1, handle_call/3, handle_cast/2, handle_info/2, terminate/2]).

-include("convoy_runtime.hrl").

-record(switch, {old :: [pid()],
                 reported = [] :: [pid()],
                 pending = #{} :: #{node() => [pid()]}}).

-record(s, {config :: convoy_config:config(),
            runtime :: #runtime{},
            switch = none :: none | #switch{}}).

-spec start_link(convoy_config:config()) -> {ok, pid()} | {error, term()}.
start_link(Config) ->
    gen_server:start_link({local, ?MODULE}, ?MODULE, Config, []).

-spec set_config(map()) -> ok | {error, convoy_config:error() | {busy, lanes} | not_started}.
set_config(Opts) ->
    try
        gen_server:call(?MODULE, {set_config, Opts}, infinity)
    catch
        exit:{noproc, _} -> {error, not_started}
    end.

%% @private
-spec init(convoy_config:config()) -> {ok, #s{}}.
init(Config = #{lanes := N}) ->
    process_flag(trap_exit, true),
    RT = start_lanes(runtime(Config, atomics:new(3 * N, [{signed, true}]), make_ref()), none),
    persistent_term:put(?RUNTIME_KEY, RT),
    {ok, #s{config = Config, runtime = RT}}.

%% Lanes start with the runtime they will serve (all of it but the lane table).
start_lanes(RT = #runtime{n = N}, Held) ->
    Lanes = [begin
                 {ok, Pid} = convoy_lane_sup:start_lane(I, Held, RT),
                 _ = erlang:monitor(process, Pid),
                 Pid
             end || I <- lists:seq(1, N)],
    RT#runtime{lanes = list_to_tuple(Lanes)}.

runtime(Config, A, Generation) ->
    #runtime{lanes = {}, generation = Generation, n = maps:get(lanes, Config), admission = A,
             max_batch = maps:get(max_batch, Config),
             max_delay = maps:get(max_delay, Config),
             large_threshold = maps:get(large_threshold, Config),
             barrier_timeout = maps:get(barrier_timeout, Config),
             bypass_after = maps:get(bypass_after, Config),
             max_buffered = maps:get(max_buffered, Config),
             max_buffered_bytes = maps:get(max_buffered_bytes, Config),
             overload = maps:get(overload, Config),
             block_timeout = maps:get(block_timeout, Config),
             telemetry = maps:get(telemetry, Config),
             config = Config}.

%% @private
-spec handle_call(term(), gen_server:from(), #s{}) -> {reply, term(), #s{}}.
handle_call({set_config, Opts}, _From, S = #s{config = Old}) ->
    case convoy_config:merge(Old, Opts) of
        {error, _} = E ->
            {reply, E, S};
        {ok, New} when map_get(lanes, New) =:= map_get(lanes, Old) ->
            #runtime{admission = A, generation = Gen, lanes = Lanes} = S#s.runtime,
            RT = (runtime(New, A, Gen))#runtime{lanes = Lanes},
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
    A = atomics:new(3 * M, [{signed, true}]),
    [atomics:put(A, M + I, -1) || I <- lists:seq(1, M)],
    RT = start_lanes(runtime(New, A, OldRT#runtime.generation), all),
    persistent_term:put(?RUNTIME_KEY, RT),
    Old = tuple_to_list(OldRT#runtime.lanes),
    OldA = OldRT#runtime.admission,
    _ = [begin
         K = atomics:add_get(OldA, I, ?CLOSED) - ?CLOSED,
         Pid ! {'$convoy_retire', K, self()}
     end || {I, Pid} <- lists:zip(lists:seq(1, length(Old)), Old)],
    S#s{config = New, runtime = RT, switch = #switch{old = Old}}.

%% @private
-spec handle_info(term(), #s{}) -> {noreply, #s{}} | {stop, term(), #s{}}.
handle_info({'$convoy_retiring', Pid, Nodes}, S = #s{switch = Sw = #switch{}}) ->
    Pending = lists:foldl(fun(N, P) -> maps:update_with(N, fun(L) -> [Pid | L] end, [Pid], P) end,
                          Sw#switch.pending, Nodes),
    Sw1 = Sw#switch{reported = [Pid | Sw#switch.reported], pending = Pending},
    case length(Sw1#switch.reported) =:= length(Sw1#switch.old) of
        true -> to_new_lanes(S, {'$convoy_hold', maps:keys(Pending)});
        false -> ok
    end,
    {noreply, S#s{switch = Sw1}};
handle_info({'$convoy_node_done', Pid, Node}, S = #s{switch = Sw = #switch{pending = P}}) ->
    Left = lists:delete(Pid, maps:get(Node, P, [])),
    P1 = case Left of
             [] -> maps:remove(Node, P);
             _ -> P#{Node := Left}
         end,
    AllReported = length(Sw#switch.reported) =:= length(Sw#switch.old),
    case Left =:= [] andalso AllReported of
        true -> to_new_lanes(S, {'$convoy_release', Node});
        false -> ok
    end,
    {noreply, S#s{switch = Sw#switch{pending = P1}}};
handle_info({'$convoy_retired', Pid}, S = #s{switch = Sw = #switch{old = Old}}) ->
    case lists:delete(Pid, Old) of
        [] -> {noreply, S#s{switch = none}};
        Rest -> {noreply, S#s{switch = Sw#switch{old = Rest,
                                                 reported = lists:delete(Pid, Sw#switch.reported)}}}
    end;
handle_info({'DOWN', _Ref, process, _Pid, normal}, S) ->
    {noreply, S};
handle_info({'DOWN', _Ref, process, Pid, Reason}, S) ->
    %% A lane died: its messages are gone and the admission counts no longer add up.
    %% Restart convoy as a whole (the supervisor is one_for_one over a fresh state).
    {stop, {lane_down, Pid, Reason}, S};
handle_info({'EXIT', _Pid, _Reason}, S) ->
    {noreply, S};
handle_info(_Msg, S) ->
    convoy_metrics:rejected(unknown_message),
    {noreply, S}.

to_new_lanes(#s{runtime = #runtime{lanes = Lanes}}, Msg) ->
    _ = [Pid ! Msg || Pid <- tuple_to_list(Lanes)],
    ok.

%% @private
-spec terminate(term(), #s{}) -> ok.
terminate(_Reason, _S) ->
    _ = persistent_term:erase(?RUNTIME_KEY),
    ok.
