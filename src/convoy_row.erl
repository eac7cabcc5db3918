%% @private
%% A node's row as a sending process reads it: what `convoy_peers' publishes for
%% the node (its route, its counters and held array, its inboxes' names), read in
%% place and never copied, or kept by the sender while its lanes run
%% (`held_refs/2'). A row forgotten between a read and its use is closed for good:
%% taking room in it, or counting a direct send with it, answers `closed', and the
%% caller reads the row again. With no `convoy_peers' (convoy's tree is being torn
%% down) a sender is never made to crash: its counts then go to counters nobody
%% keeps.
-module(convoy_row).

-export([refs/1, held_refs/2, count_direct/1, read/1, read_multi/2, lane_inbox/2,
         counters/1]).

-export_type([row/0]).

-include("convoy_tags.hrl").

%% A node's route as `convoy_path' reads it (`convoy', `unanswered', `plain', or
%% `none' before convoy has dealt with the node or while its tree is torn down),
%% its counters and its inboxes' names.
-type row() :: {convoy_path:route(), counters:counters_ref() | undefined, tuple() | none}.

%% @doc `Node''s counters and held array (`convoy_held').
-spec refs(node()) -> {counters:counters_ref(), convoy_held:held()}.
refs(Node) ->
    case convoy_peers:refs(Node) of
        {_C, _H} = Refs ->
            Refs;
        undefined ->
            convoy_metrics:new_refs()
    end.

%% @doc `refs/1' as the sender keeps them while its lanes run
%% (`convoy_sender:held_refs/2').
-spec held_refs(tuple(), node()) -> {tuple(), counters:counters_ref(), convoy_held:held()}.
held_refs(Lanes, Node) ->
    case convoy_sender:held_refs(Lanes, Node) of
        undefined -> erlang:insert_element(1, refs(Node), Lanes);
        Refs -> Refs
    end.

%% @doc Count a direct send with the node's counters, checked by a mark in the
%% counters themselves (`convoy_metrics:add_direct/1'): a row forgotten
%% meanwhile is fetched again.
-spec count_direct(node()) -> ok.
count_direct(Node) ->
    case convoy_metrics:add_direct(element(1, refs(Node))) of
        ok -> ok;
        closed -> erlang:yield(), count_direct(Node)
    end.

%% @doc `Node''s row (`row()').
-spec read(node()) -> row().
read(Node) ->
    case convoy_peers:lookup(Node) of
        {{convoy, _Vsn, Inboxes}, C, _H} -> {answering(C), C, Inboxes};
        {plain, C, _H} -> {plain, C, none};
        none -> {none, undefined, none}
    end.

%% @doc `read/1' for a multicast entry to `Tos': a publish entry goes to the inbox
%% only of a peer that reads it; for any other the lane turns it into what the
%% peer reads when it ships.
-spec read_multi(node(), term()) -> row().
read_multi(Node, {?TAG_PUBLISH, _Scope, _Group}) ->
    case convoy_peers:lookup(Node) of
        {{convoy, Vsn, Inboxes}, C, _H} ->
            case convoy_wire:supports(Vsn, publish) of
                true -> {answering(C), C, Inboxes};
                false -> {none, undefined, none}
            end;
        _ ->
            {none, undefined, none}
    end;
read_multi(Node, _Tos) ->
    read(Node).

%% A convoy peer's route: `unanswered' while a wait for its answer that ran out
%% has not been followed by an answer (see `convoy_metrics:unanswered/2').
answering(C) ->
    case convoy_metrics:is_unanswered(C) of
        false -> convoy;
        true -> unanswered
    end.

%% @doc The inbox lane `L' ships to on `Node' now (`none' when `Node' is not a
%% convoy peer).
-spec lane_inbox(pos_integer(), node()) -> atom() | none.
lane_inbox(L, Node) ->
    case convoy_peers:lookup(Node) of
        {{convoy, _Vsn, Inboxes}, _C, _H} -> convoy_wire:lane_inbox(L, Inboxes);
        _ -> none
    end.

%% @doc `Node''s counters if it has a row (none is created here).
-spec counters(node()) -> counters:counters_ref() | undefined.
counters(Node) ->
    case convoy_peers:lookup(Node) of
        {_Route, C, _H} -> C;
        none -> undefined
    end.
