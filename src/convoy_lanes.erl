%% @private
%% Each node's lanes, as senders find them and wait for them: the runtime
%% `convoy_control' publishes for each node it has started lanes for, its
%% settings and the node's own lanes (`lanes' of them) with their admission
%% counters. A connected node's is in the settings' runtime (`rows'), which a send
%% reads anyway (one read of an atom key); any other's under a key of its own
%% (reading a tuple key hashes it: about 12 ns more). A process always uses the
%% same lane of a node: the one at `phash2(self(), lanes)' among them.
%%
%% Not one table of every node's: publishing it each time a node got lanes
%% copied it whole into the literal area each time (3,000 node names sent to
%% exhausted it); connected nodes are few and change seldom.
-module(convoy_lanes).

-export([row/1, runtime/2, prober/2, rows/0, lane_of/1, lane/1, flush/2]).

-include("convoy_runtime.hrl").

-compile({inline, [lane_of/1]}).

%% @doc `Node''s runtime, or `undefined' while it has no lanes.
-spec row(node()) -> #runtime{} | undefined.
row(Node) ->
    case persistent_term:get(?RUNTIME_KEY, undefined) of
        #runtime{rows = #{Node := Row}} -> Row;
        _ -> persistent_term:get({?RUNTIME_KEY, Node}, undefined)
    end.

%% @doc `Node''s runtime with the options of `RT' (a call's), its lanes started
%% if it had none; if convoy stopped or is stopping meanwhile, the runtime
%% published then.
-spec runtime(#runtime{}, node()) -> #runtime{} | undefined.
runtime(RT = #runtime{overload = O, block_timeout = T, refuse = R}, Node) ->
    case row(Node) of
        Row = #runtime{overload = O, block_timeout = T, refuse = R} ->
            Row;
        Row = #runtime{} ->
            Row#runtime{overload = O, block_timeout = T, refuse = R};
        undefined ->
            ok = convoy_control:lanes_for(Node),
            case {row(Node), persistent_term:get(?RUNTIME_KEY, undefined)} of
                {undefined, #runtime{stopping = false}} ->
                    %% convoy_control is not there to start them: restarting
                    %% (its start publishes a new runtime), or gone with
                    %% convoy's tree (what is left published is not served)
                    case whereis(convoy_control) of
                        undefined -> undefined;
                        _ -> erlang:yield(), runtime(RT, Node)
                    end;
                {undefined, StoppingOrStopped} ->
                    StoppingOrStopped;
                {_Row, _RT} ->
                    runtime(RT, Node)
            end
    end.

%% @doc `Node''s runtime and the caller's lane there, which probes the node if a
%% wait for it runs out; with convoy not running, or stopping with no lane for
%% the node, nothing probes it (`none').
-spec prober(#runtime{} | undefined, node()) -> {#runtime{} | undefined, pos_integer() | none}.
prober(undefined, _Node) ->
    {undefined, none};
prober(RT = #runtime{stopping = true}, Node) ->
    case row(Node) of
        undefined -> {RT, none};
        Row -> {Row, lane_of(Row)}
    end;
prober(RT, Node) ->
    case runtime(RT, Node) of
        Row = #runtime{stopping = false} -> {Row, lane_of(Row)};
        StoppingOrStopped -> prober(StoppingOrStopped, Node)
    end.

%% @doc Every node's runtime, by node (reads all of persistent_term: for
%% operators and tests, not for a send).
-spec rows() -> [{node(), #runtime{}}].
rows() ->
    Connected = case persistent_term:get(?RUNTIME_KEY, undefined) of
                    #runtime{rows = Rows} -> maps:to_list(Rows);
                    undefined -> []
                end,
    lists:sort(Connected ++ [{Node, Row} || {{?RUNTIME_KEY, Node}, Row = #runtime{}}
                                                <- persistent_term:get()]).

%% @doc The calling process's lane among a node's (an index into its runtime's
%% `lanes').
-spec lane_of(#runtime{}) -> pos_integer().
lane_of(#runtime{n = 1}) -> 1;
lane_of(#runtime{n = N}) -> erlang:phash2(self(), N) + 1.

%% @doc The calling process's lane of a node's runtime, its pid.
-spec lane(#runtime{}) -> pid().
lane(Row = #runtime{lanes = Lanes}) ->
    element(lane_of(Row), Lanes).

%% @doc `convoy:flush/2', in the caller: wait until the caller's lane for `Which'
%% (a node, or every node with lanes: `all') has shipped or counted as dropped
%% everything the caller handed it. With convoy stopping, wait for the lane to
%% finish instead (bounded by the stop); with convoy not running, or for this
%% node, nothing waits.
-spec flush(node() | all, timeout()) -> ok | {error, timeout}.
flush(Which, Timeout) ->
    case persistent_term:get(?RUNTIME_KEY, undefined) of
        undefined ->
            ok;
        _ when Which =:= node() ->
            ok;
        _RT ->
            {Stopping, Running} = lists:partition(fun({_, #runtime{stopping = S}, _}) -> S end,
                                                  callers_lanes(Which)),
            %% A stopping lane ships everything and goes (the stop bounds the wait).
            lists:foreach(fun({_, _, Lane}) -> ok = convoy_wait:await_gone(Lane) end, Stopping),
            case convoy_wait:flush([{Node, Lane} || {Node, _, Lane} <- Running], Timeout) of
                ok -> ok;
                down -> flush(Which, Timeout); % a lane was replaced, or convoy restarted
                timeout -> {error, timeout}
            end
    end.

%% The caller's lane for each node `Which' names: its runtime and its pid.
callers_lanes(all) ->
    lists:append([callers_lanes(Node) || Node <- convoy_control:lane_nodes()]);
callers_lanes(Node) ->
    case row(Node) of
        undefined -> []; % no lane of its has taken anything
        Row -> [{Node, Row, lane(Row)}]
    end.
